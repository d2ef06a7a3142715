"""Score a probe answer and classify how it is wrong (the memory-confusion taxonomy).

Substring recall (RULER) calls an answer right when the gold value appears
anywhere in it, so a model that recites every value in the context passes. Here
the answer is parsed into *values* of the item's shape and each value is matched
against the item's needles.

Values
------
A value is a maximal run of the item's value shape in the answer:

``number``
    a run of digits (thousands separators removed) at least half as long as the gold value;
``uuid``
    a run of hex digits and dashes, at least 8 characters, with a digit or a dash;
``variable``
    a word of exactly as many uppercase letters as the gold variable names, or
    one of the item's variable names in any case;
``word``
    a word of the value vocabulary (:data:`kveval.probes.text.VALUE_WORDS`, the
    needles' values among them; a plural ``s``/``es`` read as its singular), or
    a near miss of a gold word that shares its first three letters (a typo).
    Around such values other words are prose ("the word is escalator, I hope
    this helps"); an answer with none holds its content words (three letters or
    more, not stopwords, not from the question) as invented values, and a
    refusal ("I don't know") holds none. A word that merely looks like the gold
    ("hello" for "cello", "guitar" for "sitar") is no near miss.

Values that occur in the question but are not needle values (the asked key,
echoed) are ignored. Duplicates count once.

Categories, in order of precedence (the first that applies)
----------------------------------------------------------
``empty``
    the answer says nothing: no letter or digit at all (blank, whitespace, punctuation).
``no_value``
    the answer says something, but holds no value of the item's shape: prose ("a very important part of the
    grass"), a refusal ("I don't know"), an echo of the asked key. Wrong, and no confusion, as ``empty``.
``correct``
    every gold value present, and no other value.
``over_inclusion``
    every gold value present *plus* other needles' values or other well-formed
    values ("escalator or maybe elephant"). Substring scoring would call it
    right; ``correct`` is False.
``stale``
    a gold value is missing and the answer holds an overwritten (stale) value of the asked key, or a near miss
    of one (as ``partial`` defines it) that is nearer to it than to any gold value.
``distractor``
    a gold value is missing and the answer holds another key's needle value, or such a near miss of one: the
    model retrieved the wrong needle, whether or not it copied it well.
``partial``
    a gold value is missing and the answer holds a near miss of one (a prefix,
    suffix or substring of at least half its length, a superstring, or edit
    similarity >= 0.7; ``detail["near"]`` says how near), or - for multi-value
    families - some but not all gold values.
``fabricated``
    anything else: well-formed values matching no needle. ``detail["in_context"]``
    says whether the first such value occurs elsewhere in the context (rare:
    the haystack has no digits).

``score`` is ``|gold & values| / |gold | values|`` over distinct values (Jaccard):
1 only when correct, the recalled fraction of gold when the answer holds no extra
values, lower when it does. ``correct`` is ``score == 1``.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field
from typing import Any

from kveval.probes.item import ProbeItem
from kveval.probes.text import VALUE_WORDS

#: The memory-confusion taxonomy, in display order: the one definition every kveval unit reads (the run-folder format
#: re-exports it, :mod:`kveval.runs.records`). An item of a task without the taxonomy records ``""``.
CATEGORIES = ("correct", "distractor", "stale", "partial", "over_inclusion", "fabricated", "no_value", "empty")
#: Wrong answers that still give a value (a confused memory); their summed rate is ``"overall"``. ``no_value`` and
#: ``empty`` answers give none: wrong, but no confusion.
CONFUSION_CATEGORIES = ("distractor", "stale", "partial", "over_inclusion", "fabricated")
#: The categories of a wrong answer that gives no value.
VALUELESS_CATEGORIES = ("no_value", "empty")
NEAR_SIMILARITY = 0.7

_STOPWORDS = frozenset("""
a about above after again against all am an and any are as at be because been before being below between both but by
can cannot could did do does doing down during each few for from further had has have having he her here hers him his
how i if in into is it its itself just let me more most my no nor not now of off on once only or other our out over own
same she should so some such than that the their them then there these they this those through to too under until up
very was we were what when where which while who whom why will with would you your yours yes sorry know unknown none
answer value values word words number numbers magic special provided text mentioned key keys given question sure
think believe seems appears also based information context passage above below following hidden memorize quiz
thank thanks please okay here's it's don't can't i'm there's that's the
hello hi find found mention mentions state states stated specify specified provide provided unable able remember
recall determine identify tell say says said sure unsure certain apologize apologies assist help helps hope clear
exist exists available seem like sentence document doesn't isn't wasn't aren't couldn't won't cannot
enough locate located unfortunately however actually really maybe perhaps probably possibly likely unclear guess
response
""".split())


@dataclass
class Score:
    """The verdict on one answer.

    Attributes
    ----------
    score : float
        In [0, 1]: Jaccard overlap of gold values and answer values.
    correct : bool
        ``category == "correct"``.
    category : str
        One of :data:`CATEGORIES`.
    recalled : str or None
        What the model gave instead of (or besides) the gold, as ``"role:value"``
        pairs joined by commas (``"distractor:8412337"``, ``"stale:1234567"``,
        ``"partial:84123"``, ``"fabricated:5550000"``); None when correct, ``no_value`` or ``empty``.
    detail : dict
        ``values`` (parsed from the answer), ``found``/``required`` gold counts, and
        for near misses ``near`` = {gold, value, prefix (shared leading characters),
        similarity (difflib ratio)}; for near misses of other needles ``near_needles`` = [{value, needle, role,
        prefix, similarity}]; for fabricated values ``in_context``.
    """

    score: float
    correct: bool
    category: str
    recalled: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.category not in CATEGORIES:
            raise ValueError(f"category {self.category!r} is not one of {', '.join(CATEGORIES)}")
        if not 0.0 <= self.score <= 1.0:
            raise ValueError(f"score {self.score} is outside [0, 1]")


#: The words a word-valued item can hold (its needles' values are drawn from them).
_VALUE_VOCABULARY = frozenset(VALUE_WORDS)
#: A UUID written without its dashes, or with typographic ones.
_DASHES = re.compile("[\u2010-\u2015\u2212]")


def _norm(value: str, kind: str) -> str:
    return value if kind == "variable" else value.lower()


def _dashed_uuid(run: str) -> str:
    """``run`` (lowercase hex, maybe dashes) with a bare 32-digit UUID given its 8-4-4-4-12 dashes."""
    if len(run) == 32 and "-" not in run:
        return "-".join((run[:8], run[8:12], run[12:16], run[16:20], run[20:]))
    return run


def _word_values(answer: str, needle_values: set[str], gold: list[str], banned: set[str]) -> list[str]:
    """The answer's word values: those of the vocabulary (a plural read as its singular) and typos of a gold word;
    where it holds none, its content words (an invented value), else nothing (prose or a refusal)."""
    vocabulary = _VALUE_VOCABULARY | needle_values
    found, content = [], []
    for word in re.findall(r"[a-z]+(?:'[a-z]+)?", answer.lower()):
        singular = next((w for w in (word[:-1], word[:-2]) if w in vocabulary), None) if word.endswith("s") else None
        if word in vocabulary or singular:
            found.append(word if word in vocabulary else singular)
        elif len(word) >= 3 and word not in _STOPWORDS and word not in banned and "'" not in word:
            if any(_word_near(word, g) for g in gold):
                found.append(word)  # a typo of a gold word
            else:
                content.append(word)
    return found or content


def extract_values(answer: str, item: ProbeItem) -> list[str]:
    """Values of the item's shape in ``answer``, in order, without duplicates (see module docstring)."""
    out: list[str] = []
    for v in _ordered_values(answer, item):
        if v not in out:
            out.append(v)
    return out


def _ordered_values(answer: str, item: ProbeItem) -> list[str]:
    """Values of the item's shape in ``answer``, in order, duplicates kept; echoes of the question left out."""
    kind = item.value_kind
    gold_len = max(len(g) for g in item.gold)
    needle_values = {_norm(n.value, kind) for n in item.needles} | {_norm(g, kind) for g in item.gold}
    if kind == "number":
        # Thousands separators join a number only in a well-formed grouping (1,234,567; 6.983.147; 6 983 147): a
        # number followed by another ("98997 100%") stays two.
        text = re.sub(r"(?<![\d.,'_])\d{1,3}(?:([,\u202f\u00a0 .'_])\d{3})(?:\1\d{3})*(?![\d]|[.,]\d)",
                      lambda m: re.sub(r"\D", "", m.group()), answer)
        found = [m for m in re.findall(r"\d+", text) if len(m) >= max(2, (gold_len + 1) // 2)]
    elif kind == "uuid":
        found = [_dashed_uuid(m.lower().strip("-")) for m in re.findall(r"[0-9a-fA-F-]{8,}", _DASHES.sub("-", answer))]
        found = [m for m in found if len(m) >= 8 and re.search(r"[0-9-]", m)]
    elif kind == "variable":  # uppercase words of the names' length, and the item's own names in any case
        found = [w.upper() for w in re.findall(rf"\b[A-Za-z]{{{gold_len}}}\b", answer)
                 if w.isupper() or w.upper() in needle_values]
    elif kind == "word":
        banned = set(re.findall(r"[a-z]+", (item.question + " " + item.answer_prefix).lower())) - needle_values
        found = _word_values(answer, needle_values, [_norm(g, kind) for g in item.gold], banned)
    else:
        raise ValueError(f"unknown value kind {kind!r}")
    question = item.question + " " + item.answer_prefix
    question = question if kind == "variable" else question.lower()
    out: list[str] = []
    for v in found:
        v = _norm(v, kind)
        if v not in needle_values and _in_context(v, question, kind):
            continue  # an echo of the asked key (a whole value of the question), not an answer value
        out.append(v)
    return out


def _near(value: str, gold: str) -> dict[str, Any] | None:
    """How near ``value`` is to ``gold``, or None when it is not a near miss."""
    prefix = len(_common_prefix(value, gold))
    similarity = difflib.SequenceMatcher(None, value, gold, autojunk=False).ratio()
    contained = (value in gold and len(value) * 2 >= len(gold)) or (gold in value)
    if contained or similarity >= NEAR_SIMILARITY:
        return {"gold": gold, "value": value, "prefix": prefix, "similarity": round(similarity, 4)}
    return None


def _word_near(value: str, gold: str) -> dict[str, Any] | None:
    """:func:`_near` for word values, where only a typo is a near miss: a word sharing the gold's first three
    letters. Another value of the vocabulary ("guitar" for "sitar") is a fabrication, and a word that merely looks
    like the gold ("corn" for "popcorn", "hello" for "cello") is no typo of it."""
    if value in _VALUE_VOCABULARY or len(_common_prefix(value, gold)) < 3:
        return None
    return _near(value, gold)


def _common_prefix(a: str, b: str) -> str:
    i = 0
    while i < min(len(a), len(b)) and a[i] == b[i]:
        i += 1
    return a[:i]


def _in_context(value: str, context: str, kind: str) -> bool:
    hay = context if kind == "variable" else context.lower()
    return re.search(rf"(?<![0-9A-Za-z]){re.escape(value)}(?![0-9A-Za-z])", hay) is not None


def score_answer(item: ProbeItem, answer: str) -> Score:
    """Score ``answer`` (the model's generated text, after the answer prefix) against ``item``; an item scored as a
    sequence (``item.scoring == "sequence"``) by :func:`score_sequence`.

    Parameters
    ----------
    item : ProbeItem
    answer : str

    Returns
    -------
    Score
        See the module docstring for the value parsing, the categories and their precedence.
    """
    if item.scoring == "sequence":
        return score_sequence(item, answer)
    kind = item.value_kind
    values = extract_values(answer or "", item)
    gold = [_norm(g, kind) for g in item.gold]
    gold_set = set(gold)
    roles: dict[str, str] = {}
    for n in item.needles:
        v = _norm(n.value, kind)
        if v not in gold_set:
            roles.setdefault(v, n.role)  # a value is stale if it is stale anywhere
            if n.role == "stale":
                roles[v] = "stale"
    found = [g for g in gold if g in values]
    needle_extras = [v for v in values if v in roles]
    other = [v for v in values if v not in gold_set and v not in roles]
    detail: dict[str, Any] = {"values": values, "found": len(set(found)), "required": len(gold_set)}

    def jaccard(extra: list[str]) -> float:
        union = gold_set | set(found) | set(extra)
        return len(set(found)) / len(union) if union else 0.0

    near_miss = _word_near if kind == "word" else _near
    if not values:
        return Score(0.0, False, valueless_category(answer), None, detail)
    if set(found) == gold_set:
        extras = needle_extras + other
        if not extras:
            return Score(1.0, True, "correct", None, detail)
        # An extra value named by the needle it is nearest to; one nearer the (found) gold is no other needle's.
        near_roles = {v: n["role"] for v in other if (n := _nearest(v, gold, roles, near_miss)) and n.get("role")}
        recalled = ",".join(f"{roles.get(v) or near_roles.get(v, 'fabricated')}:{v}" for v in extras)
        return Score(jaccard(extras), False, "over_inclusion", recalled, detail)

    missing = [g for g in gold if g not in found]
    near, near_needles = None, []
    for v in other:
        nearest = _nearest(v, missing, roles, near_miss)
        if nearest is None:
            continue
        if nearest.get("role") is None:  # the gold's
            near = near or nearest
        else:
            near_needles.append(nearest)
    if near:
        detail["near"] = near
    if near_needles:
        detail["near_needles"] = near_needles
    value_roles = {**{n["value"]: n["role"] for n in near_needles}, **{v: roles[v] for v in needle_extras}}
    # Every non-gold value counts against the score except a near miss of the gold itself.
    score = jaccard(needle_extras + [v for v in other if not near or v != near["value"]])
    for role in ("stale", "distractor"):
        hits = [v for v in values if value_roles.get(v) == role]
        if hits:
            return Score(score, False, role, ",".join(f"{role}:{v}" for v in hits), detail)
    if near or found:
        return Score(score, False, "partial", f"partial:{near['value']}" if near else None, detail)
    first = other[0]
    detail["in_context"] = _in_context(first, item.context, kind)
    return Score(score, False, "fabricated", ",".join(f"fabricated:{v}" for v in other), detail)


def valueless_category(answer: str | None) -> str:
    """The category of an answer that holds no value: ``empty`` when it says nothing (no letter or digit),
    ``no_value`` when it says something else."""
    return "no_value" if re.search(r"[^\W_]", answer or "") else "empty"


def _nearest(value: str, missing: list[str], roles: dict[str, str], near_miss) -> dict[str, Any] | None:
    """The needle ``value`` is a near miss of (``near_miss``: :func:`_near`, or :func:`_word_near` for words): a
    missing gold value (the near-miss dict as is), or another needle's value (the dict with ``needle`` and its
    ``role``, ``stale`` or ``distractor``: the model copied the wrong needle, badly). The most similar wins; the
    gold on a tie. ``None``: near none of them."""
    best = None
    for target in missing:
        near = near_miss(value, target)
        if near and (best is None or near["similarity"] > best["similarity"]):
            best = near
    for target, role in roles.items():
        near = near_miss(value, target)
        if near and (best is None or near["similarity"] > best["similarity"]):
            best = {"value": value, "needle": target, "role": role, "prefix": near["prefix"],
                    "similarity": near["similarity"]}
    return best


def sequence_values(answer: str, item: ProbeItem) -> list[str]:
    """The ordered values (duplicates kept) of the answer's first paragraph: its text up to the first blank line
    after some value, where a base model goes on to other text."""
    text = answer or ""
    for paragraph in re.split(r"\n\s*\n", text):
        values = _ordered_values(paragraph, item)
        if values:
            return values
    return []


def edit_distance(a: list[str], b: list[str]) -> int:
    """Levenshtein distance between two sequences of elements: insertions, deletions and substitutions, each 1."""
    previous = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        current = [i]
        for j, y in enumerate(b, 1):
            current.append(min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (x != y)))
        previous = current
    return previous[-1]


def _common_subsequence(a: list[str], b: list[str]) -> int:
    """Length of the longest common subsequence of ``a`` and ``b``."""
    previous = [0] * (len(b) + 1)
    for x in a:
        current = [0]
        for j, y in enumerate(b, 1):
            current.append(previous[j - 1] + 1 if x == y else max(previous[j], current[j - 1]))
        previous = current
    return previous[-1]


def score_sequence(item: ProbeItem, answer: str) -> Score:
    """Score an answer that must write ``item.gold`` out in order (long-output families,
    :mod:`kveval.probes.long_output`).

    The answer's values (:func:`sequence_values`: its first paragraph, duplicates kept) are aligned with the gold
    list by edit distance over elements: ``score = 1 - distance / max(len(values), len(gold))``, in [0, 1], 1 only
    for the exact list. ``detail`` counts ``omitted`` gold elements (gold's multiset less the answer's), ``invented``
    elements (the answer's less gold's) and ``reordered`` ones (present in both, out of the longest common
    subsequence), with ``distance`` and ``length`` (values written).

    Categories: ``correct`` (the exact list), ``empty`` (no letter or digit) or ``no_value`` (text, no value; see
    :func:`valueless_category`), ``distractor`` (a value of another key's
    needle, the tracked state of another variable), ``over_inclusion`` (every gold element in order, plus invented
    ones), ``partial`` (some gold element), else ``fabricated``.
    """
    kind = item.value_kind
    values = sequence_values(answer, item)
    gold = [_norm(g, kind) for g in item.gold]
    shared = sum(min(values.count(v), gold.count(v)) for v in set(gold))
    in_order = _common_subsequence(values, gold)
    distance = edit_distance(values, gold)
    detail: dict[str, Any] = {"values": values, "found": shared, "required": len(gold), "distance": distance,
                              "length": len(values), "omitted": len(gold) - shared, "invented": len(values) - shared,
                              "reordered": shared - in_order}
    if not values:
        return Score(0.0, False, valueless_category(answer), None, detail)
    score = 1.0 - distance / max(len(values), len(gold))
    if values == gold:
        return Score(1.0, True, "correct", None, detail)
    gold_set = set(gold)
    roles = {_norm(n.value, kind): n.role for n in item.needles if _norm(n.value, kind) not in gold_set}
    extras = [v for v in dict.fromkeys(values) if v not in gold_set]
    recalled = ",".join(f"{roles.get(v, 'fabricated')}:{v}" for v in extras) or None
    if any(roles.get(v) == "distractor" for v in extras):
        return Score(score, False, "distractor", recalled, detail)
    if in_order == len(gold):
        return Score(score, False, "over_inclusion", recalled, detail)
    return Score(score, False, "partial" if shared else "fabricated", recalled, detail)


def category_metrics(result: Score) -> dict[str, float]:
    """``score``, ``correct`` and one 0/1 indicator per category (means are rates)."""
    out = {"score": float(result.score), "correct": float(result.correct)}
    for cat in CATEGORIES:
        out[f"cat_{cat}"] = float(result.category == cat)
    return out
