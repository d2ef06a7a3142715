"""A long system prompt shared by several requests: the ``system_rules`` probe family.

The agent setting that makes caches largest in deployment: a system prompt of tool descriptions and rules, tens
of thousands of tokens, reused by every request (SCBench's shared-context setting). Its context is a catalogue
filling the requested length::

    You are the support assistant of a software company. ...
    Tool amber-falcon: call it when the user asks about refunds.
    Rule quiet-harbor: requests about invoices must be answered briefly.
    Tool misty-otter: call it when the user asks about passwords. Code of misty-otter: 4821907.
    ...

A few entries carry a code (``num_requests`` asked, ``num_distractors`` not); the rest are filler entries of
the same shapes without one. Each request (one item) asks the code of one coded entry, with no history: the
requests of one prompt are independent, share its ``group`` (one cluster for the gate's paired statistics) and
its context token ids, so :mod:`kveval.runner.generation` prefills and compresses the prompt once for all of
them (``context`` mode). Another entry's code in an answer is a ``distractor`` confusion.

Where the tokenizer's chat template renders a system message, the catalogue is the system message and the
request the user message (:meth:`~kveval.probes.prompts.PromptFrame.for_system`); without a template (a base
model) the prompt is plain text, as every family's.
"""

from __future__ import annotations

import functools
import random
from typing import Any

from kveval.probes.build import Layout, Plant, Spec, Turn, Unit
from kveval.probes.text import KEY_ADJECTIVES, KEY_NOUNS, UniqueDraw

#: What filler entries are about (generic support topics; generated text, nothing copied).
TOPICS = (
    "refunds", "invoices", "passwords", "shipping", "returns", "billing", "accounts", "subscriptions", "discounts",
    "deliveries", "warranties", "repairs", "upgrades", "downloads", "licences", "backups", "exports", "imports",
    "reports", "calendars", "reminders", "payments", "receipts", "coupons", "orders", "cancellations", "profiles",
    "notifications", "permissions", "teams", "projects", "storage", "quotas", "logins", "devices", "printers",
    "updates", "translations", "feedback", "surveys",
)
#: How a filler rule says requests must be answered.
MANNERS = ("briefly", "politely", "in plain words", "with a link to the manual", "in a numbered list",
           "in the user's language", "without jargon", "with one example")

INTRO = ("You are the support assistant of a software company. The tools you may call and the rules you must "
         "follow are listed below. Some tools and rules give a code: when a request is about one of them, answer "
         "with its code.")


def _entry(kind: str, key: str, topic: str, code: str | None = None, manner: str = "") -> str:
    """One catalogue line: a tool or a rule, with its code when it has one (``Code of <key>: <code>.``)."""
    if kind == "tool":
        line = f"Tool {key}: call it when the user asks about {topic}."
    else:
        line = f"Rule {key}: requests about {topic} must be answered {'with its code' if code else manner}."
    return f"{line} Code of {key}: {code}." if code else line


def system_rules(rng: random.Random, depth: float, p: dict[str, Any]) -> Spec:
    """A system prompt of tools and rules; ``num_requests`` independent requests each ask one entry's code.

    Entry 0 of the asked ones sits at the requested depth, the other asked entries and the ``num_distractors``
    coded entries no request asks at random depths (an item's ``depth`` is its own entry's). Asked entries
    alternate between tools and rules. Every request has the same wording, ``What is the code of <key>?``,
    answered after ``Code of <key>:`` (the words before the code in its entry), so the requests of one prompt
    differ in length by their keys' tokens alone.
    """
    kind = p["value_kind"]
    draw = UniqueDraw(rng)
    coded = p["num_requests"] + p["num_distractors"]
    keys = [draw.key() for _ in range(coded)]
    codes = [draw.value(kind) for _ in keys]
    depths = [depth] + [round(rng.random(), 4) for _ in keys[1:]]
    plants = [Plant(_entry("tool" if i % 2 == 0 else "rule", k, rng.choice(TOPICS), c), k, c, d, primary=(i == 0))
              for i, (k, c, d) in enumerate(zip(keys, codes, depths))]
    filler = _filler(rng.getrandbits(64), set(keys))

    def pad_words(k: int) -> list[str]:  # the words of the next entries, for the few tokens no whole entry fills
        return (filler(k).text + " " + filler(k + 1).text).split()

    layout = Layout(INTRO, filler, pad_words, plants, intro_sep="\n\n", joiner="\n")
    turns = [Turn(f"What is the code of {key}?", f"Code of {key}:", [code], code, d)
             for key, code, d in zip(keys[:p["num_requests"]], codes, depths)]
    return Spec(layout, turns, kind)


def _filler(seed: int, taken: set[str]):
    """Filler entry ``i`` (a tool or a rule without a code), drawn from ``seed`` and ``i`` alone, so that fitting
    the context, which asks for entries in any order, always gets the same ones; never named as a ``taken`` key."""

    @functools.lru_cache(maxsize=None)  # fitting asks for each entry many times
    def entry(i: int) -> Unit:
        r = random.Random(f"{seed}|{i}")
        key = f"{r.choice(KEY_ADJECTIVES)}-{r.choice(KEY_NOUNS)}"
        while key in taken:
            key = f"{r.choice(KEY_ADJECTIVES)}-{r.choice(KEY_NOUNS)}"
        return Unit(_entry(r.choice(("tool", "rule")), key, r.choice(TOPICS), manner=r.choice(MANNERS)))

    return entry


__all__ = ["INTRO", "system_rules"]
