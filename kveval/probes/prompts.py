"""The one prompt encoder: how a context and a question become token ids.

A prompt is rendered by a :class:`PromptFrame` (the tokenizer's chat template
split around the user message, or lm-eval's plain rendering) into
``prompt_context`` (template head + context) and ``prompt_question``
(separator + question + template tail + answer prefix), and the two halves are
tokenized separately by :func:`encode_parts`: special tokens (BOS) only on the
context, never twice. ``kveval generate`` (:func:`kveval.runner.generation.encode_prompt`)
and the probes (:func:`kveval.probes.encode_item`) both go through here, so the
same context and question give the same ids in ``generate`` and ``eval``.
"""

from __future__ import annotations

from dataclasses import dataclass

from kveval.errors import UsageError

# Placeholders used to split a rendered chat template into the context part and the question part.
_CTX_MARK = "\u2063KVEVAL_CONTEXT\u2063"
_Q_MARK = "\u2063KVEVAL_QUESTION\u2063"
CONTEXT_QUESTION_SEPARATOR = "\n\n"


def has_chat_template(tokenizer) -> bool:
    return getattr(tokenizer, "chat_template", None) is not None


@dataclass(frozen=True)
class PromptFrame:
    """The fixed text around context and question for one tokenizer.

    ``prompt_context = head + context`` and
    ``prompt_question = middle + question + tail + answer_prefix``.
    """

    head: str
    middle: str
    tail: str
    chat: bool

    @classmethod
    def for_tokenizer(cls, tokenizer) -> "PromptFrame":
        if not has_chat_template(tokenizer):
            # lm-eval's plain rendering: user text, then " " + gen_prefix.
            return cls("", CONTEXT_QUESTION_SEPARATOR, " ", False)
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": _CTX_MARK + CONTEXT_QUESTION_SEPARATOR + _Q_MARK}],
            tokenize=False, add_generation_prompt=True,
        )
        if not isinstance(rendered, str) or _CTX_MARK not in rendered or _Q_MARK not in rendered:
            raise UsageError("the tokenizer's chat template does not render the user message verbatim; "
                             "kveval cannot split its prompt into context and question")
        c = rendered.index(_CTX_MARK)
        q = rendered.index(_Q_MARK)
        return cls(rendered[:c], rendered[c + len(_CTX_MARK):q], rendered[q + len(_Q_MARK):], True)

    @classmethod
    def for_system(cls, tokenizer) -> "PromptFrame":
        """The frame of a system prompt: the context as the chat template's system message and the question as
        the user message, where the template renders both verbatim, in that order; else :meth:`for_tokenizer`
        (no template, or one that refuses a system role: the context opens the user message)."""
        if not has_chat_template(tokenizer):
            return cls.for_tokenizer(tokenizer)
        from jinja2.exceptions import TemplateError

        try:
            rendered = tokenizer.apply_chat_template(
                [{"role": "system", "content": _CTX_MARK}, {"role": "user", "content": _Q_MARK}],
                tokenize=False, add_generation_prompt=True,
            )
        except TemplateError:  # "System role not supported"
            return cls.for_tokenizer(tokenizer)
        if not isinstance(rendered, str) or not 0 <= rendered.find(_CTX_MARK) < rendered.find(_Q_MARK):
            return cls.for_tokenizer(tokenizer)
        c = rendered.index(_CTX_MARK)
        q = rendered.index(_Q_MARK)
        return cls(rendered[:c], rendered[c + len(_CTX_MARK):q], rendered[q + len(_Q_MARK):], True)

    def render(self, context: str, question: str, answer_prefix: str) -> tuple[str, str]:
        if self.chat:
            return self.head + context, self.middle + question + self.tail + answer_prefix
        return self.head + context, self.middle + question + (self.tail + answer_prefix if answer_prefix else "")


def _context_special_tokens(tokenizer, prompt_context: str) -> bool:
    """Let the tokenizer add BOS/special tokens unless the rendered template already starts with BOS."""
    bos = getattr(tokenizer, "bos_token", None)
    return not (bos and prompt_context.startswith(bos))


def encode_parts(tokenizer, prompt_context: str, prompt_question: str) -> tuple[list[int], list[int]]:
    context_ids = tokenizer(prompt_context, add_special_tokens=_context_special_tokens(tokenizer, prompt_context))["input_ids"]
    question_ids = tokenizer(prompt_question, add_special_tokens=False)["input_ids"]
    return list(context_ids), list(question_ids)


def encode_text(tokenizer, context: str, question: str = "", chat: bool | None = None,
                answer_prefix: str = "") -> tuple[list[int], list[int]]:
    """Token ids ``(context_ids, question_ids)`` of a context and a question.

    ``chat``: apply the tokenizer's chat template (default: when it has one).
    With no question (and no answer prefix) the user message is the context
    alone and the question part is the template's tail (the assistant turn).
    """
    if chat is None:
        chat = has_chat_template(tokenizer)
    frame = PromptFrame.for_tokenizer(tokenizer) if chat else PromptFrame("", CONTEXT_QUESTION_SEPARATOR, " ", False)
    if question or answer_prefix:
        prompt_context, prompt_question = frame.render(context, question, answer_prefix)
    else:
        prompt_context, prompt_question = frame.head + context, frame.tail if frame.chat else ""
    return encode_parts(tokenizer, prompt_context, prompt_question)


__all__ = ["CONTEXT_QUESTION_SEPARATOR", "PromptFrame", "encode_parts", "encode_text", "has_chat_template"]
