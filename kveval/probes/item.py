"""Probe items: what a runner needs to prefill a context, compress it, then ask the question.

A :class:`ProbeItem` carries the raw ``context`` and ``question`` (for lm-eval,
which applies chat templates itself) and the *rendered* prompt split in two:
``prompt_context`` (chat-template start + context) and ``prompt_question``
(question + template end + assistant start + answer prefix). :func:`encode_item`
tokenizes the two halves separately; their concatenation IS the prompt, and all
token positions (``length``, needle ``span``) refer to it.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from kveval.errors import UsageError

ROLES = ("target", "distractor", "stale")
SCORINGS = ("values", "sequence")

from kveval.probes.prompts import (
    CONTEXT_QUESTION_SEPARATOR,
    PromptFrame,
    _context_special_tokens,
    encode_parts,
    has_chat_template,
)


@dataclass
class Needle:
    """One planted fact.

    Attributes
    ----------
    key : str
        What the fact is about (``"amber-falcon"``, a UUID key, or for
        ``variable_tracking`` the chain's numeric value).
    value : str
        The value an answer would contain (a number, word, UUID or variable name).
    role : str
        ``"target"`` (asked for), ``"distractor"`` (another key's value) or
        ``"stale"`` (an overwritten earlier value of the asked key).
    span : tuple of int
        ``(start, end)`` token indices of the needle text within the prompt
        (``context_ids + question_ids`` of :func:`encode_item`), end exclusive.
    """

    key: str
    value: str
    role: str
    span: tuple[int, int] = (0, 0)

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise UsageError(f"needle role {self.role!r} is not one of {', '.join(ROLES)}")
        self.span = (int(self.span[0]), int(self.span[1]))
        if not 0 <= self.span[0] <= self.span[1]:
            raise UsageError(f"needle span {self.span} must satisfy 0 <= start <= end")


@dataclass
class ProbeItem:
    """One probe prompt with its gold answer(s) and planted needles.

    Attributes
    ----------
    id : str
        Stable id, ``"{family}-{length}-{depth:.2f}-s{seed}-{index}"`` (``-t{turn}``
        appended for ``multi_turn``).
    hash : str
        sha256 (hex) of the rendered prompt text ``prompt_context + prompt_question``.
    family : str
        Probe family (a key of :data:`kveval.probes.FAMILIES`).
    params : dict
        Generation parameters: requested ``length`` (tokens), ``seed``, ``index``,
        ``tokenizer`` name and the family parameters.
    context, question : str
        Raw text, no chat template. ``context + "\\n\\n" + question`` is the user message.
    prompt_context, prompt_question : str
        The rendered prompt in two parts (see module docstring).
    gold : list of str
        Values a correct answer must contain (all of them).
    needles : list of Needle
        Every planted value in order of appearance, with its role for this item.
    length : int
        Actual prompt length in tokens (context part + question part).
    depth : float
        Requested relative depth in [0, 1] of the primary target needle.
    depth_actual : float
        Measured depth: tokens of the haystack region before the primary target
        needle divided by the region's tokens without that needle.
    group : str
        Items sharing one context share a group (``multi_turn``); else the id.
    turn : int
        Turn index within the group (0 for single-turn families).
    max_new_tokens : int
        Generation budget for a greedy answer.
    answer_prefix : str
        Text the assistant turn starts with (already inside ``prompt_question``;
        for lm-eval it is the ``gen_prefix``).
    value_kind : str
        Shape of the values: ``number``, ``word``, ``uuid`` or ``variable``.
    scoring : str
        ``"values"`` (the answer's set of values against ``gold``) or ``"sequence"`` (``gold`` is an ordered list
        the answer must write out in order, duplicates included: :func:`kveval.probes.scoring.score_sequence`).
    """

    id: str
    hash: str
    family: str
    params: dict[str, Any]
    context: str
    question: str
    prompt_context: str
    prompt_question: str
    gold: list[str]
    needles: list[Needle]
    length: int
    depth: float
    depth_actual: float = 0.0
    group: str = ""
    turn: int = 0
    max_new_tokens: int = 32
    answer_prefix: str = ""
    value_kind: str = "number"
    scoring: str = "values"

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise UsageError(f"item {self.id}: scoring {self.scoring!r} is not one of {', '.join(SCORINGS)}")
        if not self.gold:
            raise UsageError(f"item {self.id}: gold must hold at least one value")
        if not 0.0 <= float(self.depth) <= 1.0:
            raise UsageError(f"item {self.id}: depth {self.depth} is outside [0, 1]")
        self.depth = float(self.depth)
        self.depth_actual = float(self.depth_actual)
        self.needles = [n if isinstance(n, Needle) else Needle(**n) for n in self.needles]
        if not self.group:
            self.group = self.id

    @property
    def prompt(self) -> str:
        return self.prompt_context + self.prompt_question

    @property
    def text(self) -> str:
        """The raw user message: context, a blank line, the question (no chat template)."""
        return self.context + CONTEXT_QUESTION_SEPARATOR + self.question

    def random_seed(self, base: int) -> int:
        """The ``random`` control's seed for this item: ``base`` plus a hash of its id, so that what it drops does
        not depend on the batch it runs in (nor on a resumed sweep's batches). The requests of one shared system
        prompt (``params["system_prompt"]``) hash their group instead: one seed for the prompt, so that its
        compressed prefix is one, shared by every request (:func:`kveval.runner.prefixes.plan_prefixes`)."""
        name = self.group if self.params.get("system_prompt") else self.id
        return (base + int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big")) % 2**31

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        for needle in data["needles"]:
            needle["span"] = list(needle["span"])
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "ProbeItem":
        names = {f.name for f in fields(cls)}
        kwargs = {k: v for k, v in data.items() if k in names}
        kwargs["needles"] = [Needle(key=n["key"], value=n["value"], role=n["role"], span=tuple(n["span"]))
                             for n in data.get("needles", [])]
        kwargs["gold"] = list(data["gold"])
        kwargs["params"] = dict(data.get("params") or {})
        return cls(**kwargs)


def prompt_hash(prompt_context: str, prompt_question: str) -> str:
    return hashlib.sha256((prompt_context + prompt_question).encode("utf-8")).hexdigest()


def encode_item(tokenizer, item: ProbeItem) -> tuple[list[int], list[int]]:
    """Tokenize an item's prompt: the one place prompts are turned into ids.

    Parameters
    ----------
    tokenizer
        The tokenizer the item was generated with.
    item : ProbeItem

    Returns
    -------
    (context_ids, question_ids) : tuple of list of int
        Special tokens (BOS) only on the context part, and only when the rendered
        chat template does not already start with the BOS text. The prompt is
        ``context_ids + question_ids``; prefill the first, compress, then feed the second.
    """
    return encode_parts(tokenizer, item.prompt_context, item.prompt_question)


def char_spans_to_tokens(tokenizer, prompt_context: str, char_spans: list[tuple[int, int]]) -> tuple[list[tuple[int, int]], int]:
    """Map character spans of ``prompt_context`` to token spans of its encoding.

    Returns the token spans and the number of context tokens. Uses offset
    mappings (fast tokenizers); slow tokenizers fall back to prefix tokenization.
    """
    special = _context_special_tokens(tokenizer, prompt_context)
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(prompt_context, add_special_tokens=special, return_offsets_mapping=True)
        real = [(i, s, e) for i, (s, e) in enumerate(enc["offset_mapping"]) if e > s]  # skip added special tokens
        starts = [s for _, s, _ in real]
        ends = [e for _, _, e in real]
        spans = []
        for a, b in char_spans:
            first = bisect.bisect_right(ends, a)  # first token ending after a
            last = bisect.bisect_left(starts, b) - 1  # last token starting before b
            if first > last:
                raise UsageError(f"no token covers characters {a}:{b} of the prompt")
            spans.append((real[first][0], real[last][0] + 1))
        return spans, len(enc["input_ids"])
    n = len(tokenizer(prompt_context, add_special_tokens=special)["input_ids"])
    spans = []
    for a, b in char_spans:
        start = len(tokenizer(prompt_context[:a], add_special_tokens=special)["input_ids"])
        end = len(tokenizer(prompt_context[:b], add_special_tokens=special)["input_ids"])
        spans.append((min(start, n), min(max(end, start + 1), n)))
    return spans, n


def read_probe_items(path: str | Path) -> list[ProbeItem]:
    """Read a file written by ``kveval probes`` (one :meth:`ProbeItem.to_dict` per line) back into items."""
    items = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), start=1):
        if line.strip():
            try:
                items.append(ProbeItem.from_dict(json.loads(line)))
            except (json.JSONDecodeError, KeyError, TypeError) as exc:
                raise UsageError(f"{path}:{number}: not a probe item ({exc})") from exc
    return items
