"""Long-output probe families: answers of tens of tokens, so the cache grows while the model writes.

Both ask the model to write out an ordered list it read in the context, and are scored as a sequence
(:func:`kveval.probes.scoring.score_sequence`: one minus the normalized edit distance over elements, ``correct``
only for the exact list):

``recite_list``
    ``num_items`` words written once, numbered, in one sentence at the item's depth ("The list of 12 words, in
    order: 1. tapir, 2. mango, ..."); the answer, which starts as that sentence does, is every word in order: a
    copy that an evicted word of the list, or of the answer written so far, can break.
``state_trace``
    a counter of one key set, then updated ``num_updates - 1`` times through the context, between the updates of
    ``num_distractors`` other keys' counters; the answer is every value the asked counter held, first to last
    (a value of another counter is a ``distractor``).

Every element is a needle (role ``target``). ``recite_list``'s list starts at the item's depth, its words one
sentence in order (``depth_actual``, its last word's, the primary needle's, lies up to the list's length further);
``state_trace``'s at evenly spread depths, the item's ``depth``
placing the one nearest it exactly, the others keeping their order around it.
"""

from __future__ import annotations

import random
from typing import Any

from kveval.probes.build import Layout, Plant, Spec, Turn, Unit
from kveval.probes.text import SentenceStream, UniqueDraw

#: Filler the families accept: the repeated sentences or the shipped prose.
HAYSTACKS = ("repeat", "prose")


def _filler(kind: str, rng: random.Random):
    """(units, pad_words) of a sentence haystack."""
    stream = SentenceStream(kind, rng)
    return (lambda i: Unit(stream[i])), (lambda k: (stream[k] + " " + stream[k + 1]).split())


def _ordered_plants(texts: list[str], key: str, values: list[str], depth: float) -> tuple[list[Plant], str]:
    """Plants of an ordered list at evenly spread depths, ``(i + 0.5) / n`` for element ``i``; the element nearest
    ``depth`` is the primary needle, placed at ``depth`` exactly, the others before or after it in order. Returns
    the plants and the primary element's value."""
    n = len(values)
    spread = [(i + 0.5) / n for i in range(n)]
    primary = min(range(n), key=lambda i: (abs(spread[i] - depth), i))
    spread[primary] = depth
    plants = []
    for i, (text, value) in enumerate(zip(texts, values)):
        order = "" if i == primary else ("before" if i < primary else "after")
        # A neighbour of the moved primary must not cross it: clamp its depth to the primary's side.
        d = min(spread[i], depth) if i < primary else max(spread[i], depth) if i > primary else depth
        plants.append(Plant(text, key, value, d, primary=i == primary, order=order))
    return plants, values[primary]


def recite_list(rng: random.Random, depth: float, p: dict[str, Any]) -> Spec:
    """An ordered list of words, written out once at the requested depth; write them all out in order."""
    n = p["num_items"]
    draw = UniqueDraw(rng)
    words = [draw.word() for _ in range(n)]
    lead = f"The list of {n} words, in order:"
    # One needle per word, numbered, all at the item's depth: the others in order, then the last (the primary)
    # right after them (its nearest gap that follows them), so that the list reads as one sentence.
    texts = [f"{i + 1}. {w}" + ("." if i == n - 1 else ",") for i, w in enumerate(words)]
    texts[0] = f"{lead} {texts[0]}"
    plants = [Plant(text, "list", w, depth, primary=i == n - 1, order="" if i == n - 1 else "before")
              for i, (text, w) in enumerate(zip(texts, words))]
    units, pad = _filler(p["haystack"], rng)
    intro = (f"A list of {n} words is hidden in the following text. Memorize the list in order. I will ask you to "
             "write it out afterwards.")
    question = f"Write out all {n} words of the list, in order, numbered as in the text."
    prefix = f"{lead} 1."
    return Spec(Layout(intro, units, pad, plants), [Turn(question, prefix, words, words[-1], depth)], "word",
                scoring="sequence", answer_room=3.0)  # room for the numbers written between the words


def state_trace(rng: random.Random, depth: float, p: dict[str, Any]) -> Spec:
    """A counter updated step by step through the context, among other counters; write out every value it held."""
    n = p["num_updates"]
    draw = UniqueDraw(rng)
    key = draw.key()
    values = [draw.number(4) for _ in range(n)]
    texts = [f"The counter for {key} starts at {v}." if i == 0 else f"Update: the counter for {key} is now {v}."
             for i, v in enumerate(values)]
    plants, primary = _ordered_plants(texts, key, values, depth)
    for _ in range(p["num_distractors"]):
        other = draw.key()
        for i, d in enumerate(sorted(rng.random() for _ in range(n // 2 or 1))):
            v = draw.number(4)
            text = f"The counter for {other} starts at {v}." if i == 0 else f"Update: the counter for {other} is now {v}."
            plants.append(Plant(text, other, v, d))
    units, pad = _filler(p["haystack"], rng)
    intro = ("Some counters are set and then updated in the following text. Track every value each counter "
             "holds. I will ask you to write out the values of one counter afterwards.")
    question = (f"Write out every value the counter for {key} held, from the first to the last, "
                "separated by commas.")
    prefix = f"The values of the counter for {key}, from the first to the last, are:"
    return Spec(Layout(intro, units, pad, plants), [Turn(question, prefix, values, primary, depth)], "number",
                scoring="sequence")


__all__ = ["HAYSTACKS", "recite_list", "state_trace"]
