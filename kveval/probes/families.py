"""Probe families: one generator per family, a registry with defaults, and :func:`generate_items`.

Each generator draws keys, values and needle depths from a seeded
:class:`random.Random` and returns a :class:`Spec`: a :class:`~kveval.probes.build.Layout`
plus one or more :class:`Turn` (questions asked against that one context).
:func:`generate_items` fits the layout to the requested token length with the
model's tokenizer and renders one :class:`~kveval.probes.item.ProbeItem` per turn.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Sequence

from kveval.errors import UsageError
from kveval.probes.build import Layout, Plant, Spec, Turn, Unit, fit
from kveval.probes.item import Needle, ProbeItem, PromptFrame, encode_parts, prompt_hash
from kveval.probes.long_output import HAYSTACKS, recite_list, state_trace
from kveval.probes.shared_prompt import system_rules
from kveval.probes.text import REPEAT_SENTENCES, SentenceStream, UniqueDraw, kind_noun
from kveval.values import is_whole

DEFAULT_DEPTHS = (0.0, 0.25, 0.5, 0.75, 1.0)
LENGTH_TOLERANCE = 0.02


# ----------------------------------------------------------------------------- haystack helpers

def _repeat_words(start: int, sentences: int = 25) -> list[str]:
    """Words of ``sentences`` filler sentences: enough to pad the gap a whole unit (even a UUID pair) leaves."""
    words: list[str] = []
    for i in range(start, start + sentences):
        words.extend(REPEAT_SENTENCES[i % len(REPEAT_SENTENCES)].split())
    return words


def _sentence_layout(kind: str, rng: random.Random) -> tuple[Callable[[int], Unit], Callable[[int], list[str]]]:
    stream = SentenceStream(kind, rng)

    def units(i: int) -> Unit:
        return Unit(stream[i])

    def pad_words(k: int) -> list[str]:
        return (stream[k] + " " + stream[k + 1]).split()

    return units, pad_words


class _LazyStream:
    """Units drawn lazily but always in index order, so fitting order cannot change them."""

    def __init__(self, make: Callable[[], Unit]):
        self._make = make
        self._items: list[Unit] = []

    def __call__(self, i: int) -> Unit:
        while len(self._items) <= i:
            self._items.append(self._make())
        return self._items[i]


def _haystack(kind: str, rng: random.Random, draw: UniqueDraw, needle_maker: Callable[[str, str], str] | None,
              value_kind: str = "number"):
    """(units, pad_words) for a ``repeat``, ``prose`` or ``needles`` haystack."""
    if kind in ("repeat", "prose"):
        return _sentence_layout(kind, rng)
    if kind != "needles" or needle_maker is None:
        raise UsageError(f"unknown haystack {kind!r}")
    stream_draw = UniqueDraw(random.Random(rng.getrandbits(64)))
    stream_draw.used = draw.used  # never reuse a target's key or value

    def make() -> Unit:
        key, value = stream_draw.key(), stream_draw.value(value_kind)
        return Unit(needle_maker(key, value), key, value)

    return _LazyStream(make), lambda k: _repeat_words(k)


def _join_keys(keys: Sequence[str]) -> str:
    if len(keys) == 1:
        return keys[0]
    return ", ".join(keys[:-1]) + " and " + keys[-1]


def _niah_needle(value_kind: str) -> Callable[[str, str], str]:
    nouns = kind_noun(value_kind, plural=True)
    return lambda key, value: f"One of the special magic {nouns} for {key} is: {value}."


def _niah_intro(value_kind: str) -> str:
    nouns = kind_noun(value_kind, plural=True)
    return (f"Some special magic {nouns} are hidden within the following text. Make sure to memorize it. "
            f"I will quiz you about the {nouns} afterwards.")


def _single_question(value_kind: str, key: str) -> tuple[str, str]:
    noun = kind_noun(value_kind)
    return (f"What is the special magic {noun} for {key} mentioned in the provided text?",
            f"The special magic {noun} for {key} mentioned in the provided text is")


def _multi_question(value_kind: str, keys: Sequence[str]) -> tuple[str, str]:
    nouns = kind_noun(value_kind, plural=True)
    joined = _join_keys(keys)
    return (f"What are all the special magic {nouns} for {joined} mentioned in the provided text?",
            f"The special magic {nouns} for {joined} mentioned in the provided text are")


# ----------------------------------------------------------------------------- families

def passkey(rng: random.Random, depth: float, p: dict[str, Any]) -> Spec:
    """Passkey retrieval (Mohtashami & Jaggi 2023): one 5-digit pass key in filler."""
    draw = UniqueDraw(rng)
    value = draw.number(5)
    units, pad = _haystack(p["haystack"], rng, draw, None)
    needle = f"The pass key is {value}. Remember it. {value} is the pass key."
    layout = Layout(
        intro=("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
               "I will quiz you about the important information there."),
        units=units, pad_words=pad, plants=[Plant(needle, "pass key", value, depth, primary=True)],
    )
    return Spec(layout, [Turn("What is the pass key?", "The pass key is", [value], value, depth)], "number")


def niah_single(rng: random.Random, depth: float, p: dict[str, Any]) -> Spec:
    """RULER single needle: one key, one value (number, word or UUID)."""
    kind = p["value_kind"]
    draw = UniqueDraw(rng)
    key, value = draw.key(), draw.value(kind)
    make = _niah_needle(kind)
    units, pad = _haystack(p["haystack"], rng, draw, make, kind)
    layout = Layout(_niah_intro(kind), units, pad, [Plant(make(key, value), key, value, depth, primary=True)])
    q, prefix = _single_question(kind, key)
    return Spec(layout, [Turn(q, prefix, [value], value, depth)], kind)


def niah_multikey(rng: random.Random, depth: float, p: dict[str, Any]) -> Spec:
    """RULER multi-key: the target plus distractor needles of other keys (or a haystack of needles)."""
    kind = p["value_kind"]
    draw = UniqueDraw(rng)
    key, value = draw.key(), draw.value(kind)
    make = _niah_needle(kind)
    plants = [Plant(make(key, value), key, value, depth, primary=True)]
    n_distractors = p["num_distractors"] if p["haystack"] != "needles" else 0
    for _ in range(n_distractors):
        k, v = draw.key(), draw.value(kind)
        plants.append(Plant(make(k, v), k, v, rng.random()))
    units, pad = _haystack(p["haystack"], rng, draw, make, kind)
    q, prefix = _single_question(kind, key)
    return Spec(Layout(_niah_intro(kind), units, pad, plants), [Turn(q, prefix, [value], value, depth)], kind)


def niah_multivalue(rng: random.Random, depth: float, p: dict[str, Any]) -> Spec:
    """RULER multi-value: several values of one key; the answer needs all of them."""
    kind = p["value_kind"]
    draw = UniqueDraw(rng)
    key = draw.key()
    values = [draw.value(kind) for _ in range(p["num_values"])]
    make = _niah_needle(kind)
    plants = [Plant(make(key, values[0]), key, values[0], depth, primary=True)]
    plants += [Plant(make(key, v), key, v, rng.random()) for v in values[1:]]
    for _ in range(p["num_distractors"]):
        k, v = draw.key(), draw.value(kind)
        plants.append(Plant(make(k, v), k, v, rng.random()))
    units, pad = _haystack(p["haystack"], rng, draw, make, kind)
    q, prefix = _multi_question(kind, [key])
    return Spec(Layout(_niah_intro(kind), units, pad, plants), [Turn(q, prefix, values, values[0], depth)], kind)


def niah_multiquery(rng: random.Random, depth: float, p: dict[str, Any]) -> Spec:
    """RULER multi-query: several keys asked at once; the answer needs every asked key's value."""
    kind = p["value_kind"]
    draw = UniqueDraw(rng)
    make = _niah_needle(kind)
    keys = [draw.key() for _ in range(p["num_queries"])]
    values = [draw.value(kind) for _ in keys]
    plants = [Plant(make(keys[0], values[0]), keys[0], values[0], depth, primary=True)]
    plants += [Plant(make(k, v), k, v, rng.random()) for k, v in zip(keys[1:], values[1:])]
    for _ in range(p["num_distractors"]):
        k, v = draw.key(), draw.value(kind)
        plants.append(Plant(make(k, v), k, v, rng.random()))
    units, pad = _haystack(p["haystack"], rng, draw, make, kind)
    q, prefix = _multi_question(kind, keys)
    return Spec(Layout(_niah_intro(kind), units, pad, plants), [Turn(q, prefix, values, values[0], depth)], kind)


def kv_retrieval(rng: random.Random, depth: float, p: dict[str, Any]) -> Spec:
    """Lost-in-the-middle KV retrieval: a JSON object of UUID -> UUID pairs, one key asked.

    The JSON fills the context; the few tokens a whole pair cannot fill are padded
    with repeat filler *before* the instruction, outside the JSON.
    """
    draw = UniqueDraw(rng)
    key, value = draw.uuid(), draw.uuid()
    stream_draw = UniqueDraw(random.Random(rng.getrandbits(64)))
    stream_draw.used = draw.used

    def make() -> Unit:
        k, v = stream_draw.uuid(), stream_draw.uuid()
        return Unit(f'"{k}": "{v}"', k, v)

    layout = Layout(
        intro="Extract the value corresponding to the specified key in the JSON object below.\n\nJSON data:\n{",
        units=_LazyStream(make), pad_words=lambda k: _repeat_words(0),
        plants=[Plant(f'"{key}": "{value}"', key, value, depth, primary=True)],
        intro_sep="\n", joiner=",\n", outro="\n}", pad_at_head=True,
    )
    q = f'What is the value corresponding to the key "{key}" in the JSON object above?'
    prefix = f'The value corresponding to the key "{key}" is:'
    return Spec(layout, [Turn(q, prefix, [value], value, depth)], "uuid")


def variable_tracking(rng: random.Random, depth: float, p: dict[str, Any]) -> Spec:
    """RULER variable tracking: ``VAR X = 12345`` then ``VAR Y = VAR X`` hops; find all variables equal to the value.

    The target chain starts at the requested depth and its later hops follow in
    order; distractor chains (other values) are spread at random depths.
    """
    draw = UniqueDraw(rng)
    n_vars = p["num_hops"] + 1
    plants: list[Plant] = []
    chains = []
    for c in range(1 + p["num_distractors"]):
        value = draw.number(5)
        names = [draw.variable() for _ in range(n_vars)]
        chains.append((value, names))
        # Target chain: its first hop sits at the depth (the rest after it) for depth <= 0.5, its last hop
        # (the rest before it) above 0.5, so that the primary hop can reach both ends of the context.
        head = depth <= 0.5
        if c == 0 and head:
            depths = [depth] + sorted(depth + (1 - depth) * rng.random() for _ in range(n_vars - 1))
        elif c == 0:
            depths = sorted(depth * rng.random() for _ in range(n_vars - 1)) + [depth]
        else:
            depths = sorted(rng.random() for _ in range(n_vars))
        primary_hop = 0 if head else n_vars - 1
        for i, (name, d) in enumerate(zip(names, depths)):
            text = f"VAR {name} = {value}." if i == 0 else f"VAR {name} = VAR {names[i - 1]}."
            order = "" if c or i == primary_hop else ("after" if i > primary_hop else "before")
            plants.append(Plant(text, value, name, d, primary=(c == 0 and i == primary_hop), order=order))
    units, pad = _haystack(p["haystack"], rng, draw, None)
    value, names = chains[0]
    layout = Layout("Memorize and track the chain(s) of variable assignment hidden in the following text.", units, pad, plants)
    q = f"Find all variables that are assigned the value {value} in the text above."
    prefix = (f"According to the chain(s) of variable assignment in the text above, {n_vars} variables "
              f"are assigned the value {value}, they are:")
    return Spec(layout, [Turn(q, prefix, names, names[0] if depth <= 0.5 else names[-1], depth)], "variable")


def update_stream(rng: random.Random, depth: float, p: dict[str, Any]) -> Spec:
    """Keys reassigned several times through the text; the question asks the latest value.

    The asked key's last assignment sits at the requested depth and its earlier
    (stale) assignments come before it; other keys' assignments are spread at
    random depths and count as distractors.
    """
    kind = p["value_kind"]
    noun = kind_noun(kind)
    draw = UniqueDraw(rng)
    keys = [draw.key() for _ in range(p["num_keys"])]
    plants: list[Plant] = []
    history: list[str] = []
    for c, key in enumerate(keys):
        values = [draw.value(kind) for _ in range(p["num_updates"])]
        if c == 0:
            history = values
            depths = sorted(depth * rng.random() for _ in range(len(values) - 1)) + [depth]
        else:
            depths = sorted(rng.random() for _ in values)
        for i, (v, d) in enumerate(zip(values, depths)):
            text = (f"The special magic {noun} for {key} is: {v}." if i == 0
                    else f"Update: the special magic {noun} for {key} is now: {v}.")
            last = i == len(values) - 1
            plants.append(Plant(text, key, v, d, primary=(c == 0 and last), order="before" if c == 0 and not last else ""))
    units, pad = _haystack(p["haystack"], rng, draw, None)
    nouns = kind_noun(kind, plural=True)
    intro = (f"Some special magic {nouns} are hidden within the following text, and some of them are updated later "
             f"in the text. Make sure to memorize the latest value for each key. I will quiz you about the {nouns} afterwards.")
    key = keys[0]
    q = f"What is the latest special magic {noun} for {key} mentioned in the provided text?"
    prefix = f"The latest special magic {noun} for {key} mentioned in the provided text is"
    return Spec(Layout(intro, units, pad, plants), [Turn(q, prefix, [history[-1]], history[-1], depth, history[:-1])], kind)


def multi_turn(rng: random.Random, depth: float, p: dict[str, Any]) -> Spec:
    """Several questions against one shared context, one item per turn.

    Turn ``t`` asks key ``t``; its question text first lists the earlier turns'
    questions with their gold answers as history. Key 0 sits at the requested
    depth, the other asked keys and the distractor keys at random depths (an
    item's ``depth`` is its own key's requested depth; for turns after the first
    it is random and only approximately met when needles cluster: use
    ``depth_actual``). Every turn shares ``prompt_context`` (and so
    ``context_ids``); the context is fitted to the longest, last turn.
    """
    kind = p["value_kind"]
    draw = UniqueDraw(rng)
    make = _niah_needle(kind)
    keys = [draw.key() for _ in range(p["num_turns"])]
    values = [draw.value(kind) for _ in keys]
    depths = [depth] + [round(rng.random(), 4) for _ in keys[1:]]
    plants = [Plant(make(k, v), k, v, d, primary=(i == 0)) for i, (k, v, d) in enumerate(zip(keys, values, depths))]
    n_distractors = p["num_distractors"] if p["haystack"] != "needles" else 0
    for _ in range(n_distractors):
        k, v = draw.key(), draw.value(kind)
        plants.append(Plant(make(k, v), k, v, rng.random()))
    units, pad = _haystack(p["haystack"], rng, draw, make, kind)
    turns = []
    for t, (key, value) in enumerate(zip(keys, values)):
        q, prefix = _single_question(kind, key)
        if t:
            history = "\n".join(f"Q: {_single_question(kind, k)[0]}\nA: {v}" for k, v in zip(keys[:t], values[:t]))
            q = f"Earlier questions and answers:\n{history}\n\nNew question: {q}"
        turns.append(Turn(q, prefix, [value], value, depths[t]))
    return Spec(Layout(_niah_intro(kind), units, pad, plants), turns, kind)


# ----------------------------------------------------------------------------- registry

@dataclass(frozen=True)
class Family:
    """A probe family: its generator, default parameters and allowed choices.

    Attributes
    ----------
    name : str
    generator : callable
        ``(rng, depth, params) -> Spec``.
    defaults : dict
        Every parameter the family takes, with its default.
    choices : dict
        Allowed values for string parameters (``haystack``, ``value_kind``).
    description : str
    system_prompt : bool
        The context is a system prompt that the family's requests share (:mod:`kveval.probes.shared_prompt`): it
        is the chat template's system message where the template has one (:meth:`PromptFrame.for_system`), and
        its items record ``params["system_prompt"]`` (:meth:`ProbeItem.random_seed`: one seed per group).
    """

    name: str
    generator: Callable[[random.Random, float, dict[str, Any]], Spec]
    defaults: dict[str, Any]
    choices: dict[str, tuple[str, ...]]
    description: str
    system_prompt: bool = False

    def resolve(self, params: dict[str, Any]) -> dict[str, Any]:
        """Defaults overridden by ``params``; unknown names and bad values raise ValueError."""
        unknown = sorted(set(params) - set(self.defaults))
        if unknown:
            raise UsageError(f"{self.name}: unknown parameter(s) {', '.join(unknown)}; "
                             f"valid: {', '.join(sorted(self.defaults)) or 'none'}")
        out = dict(self.defaults)
        out.update({k: v for k, v in params.items() if v is not None})
        for name, allowed in self.choices.items():
            if out[name] not in allowed:
                raise UsageError(f"{self.name}: {name}={out[name]!r} is not one of {', '.join(allowed)}")
        for name, value in out.items():
            if name.startswith("num_"):
                if not is_whole(value) or value < 0:
                    raise UsageError(f"{self.name}: {name} must be a non-negative integer, not {value!r}")
        minimum = {"num_items": 1, "num_values": 1, "num_queries": 1, "num_keys": 1, "num_updates": 1, "num_turns": 1,
                   "num_hops": 0, "num_requests": 1}
        for name, low in minimum.items():
            if name in out and out[name] < low:
                raise UsageError(f"{self.name}: {name} must be at least {low}")
        return out

    def tag(self, params: dict[str, Any]) -> str:
        """Family name plus non-default parameters, for ids: ``niah_single[value_kind=uuid]``."""
        diff = [f"{k}={params[k]}" for k in sorted(params) if params[k] != self.defaults.get(k)]
        return f"{self.name}[{','.join(diff)}]" if diff else self.name


_HAY = ("repeat", "prose")
_HAY_N = ("repeat", "prose", "needles")
_KINDS = ("number", "word", "uuid")

FAMILIES: dict[str, Family] = {f.name: f for f in (
    Family("passkey", passkey, {"haystack": "repeat"}, {"haystack": _HAY},
           "pass key in filler (Mohtashami & Jaggi)"),
    Family("niah_single", niah_single, {"haystack": "repeat", "value_kind": "number"},
           {"haystack": _HAY, "value_kind": _KINDS}, "RULER single needle"),
    Family("niah_multikey", niah_multikey, {"haystack": "repeat", "value_kind": "number", "num_distractors": 3},
           {"haystack": _HAY_N, "value_kind": _KINDS}, "target among distractor needles of other keys"),
    Family("niah_multivalue", niah_multivalue,
           {"haystack": "repeat", "value_kind": "number", "num_values": 4, "num_distractors": 0},
           {"haystack": _HAY_N, "value_kind": _KINDS}, "all values of one key"),
    Family("niah_multiquery", niah_multiquery,
           {"haystack": "repeat", "value_kind": "number", "num_queries": 2, "num_distractors": 2},
           {"haystack": _HAY_N, "value_kind": _KINDS}, "several keys asked at once"),
    Family("kv_retrieval", kv_retrieval, {}, {}, "JSON of UUID -> UUID pairs, one key asked"),
    Family("variable_tracking", variable_tracking, {"haystack": "repeat", "num_hops": 4, "num_distractors": 1},
           {"haystack": _HAY}, "multi-hop VAR X = VAR Y chains with distractor chains"),
    Family("update_stream", update_stream,
           {"haystack": "repeat", "value_kind": "number", "num_keys": 3, "num_updates": 3},
           {"haystack": _HAY, "value_kind": _KINDS}, "keys reassigned; the latest value is asked"),
    Family("multi_turn", multi_turn,
           {"haystack": "repeat", "value_kind": "number", "num_turns": 3, "num_distractors": 2},
           {"haystack": _HAY_N, "value_kind": _KINDS}, "several questions against one shared context"),
    Family("recite_list", recite_list, {"haystack": "repeat", "num_items": 12}, {"haystack": HAYSTACKS},
           "long output: write out a list of words spread through the context, in order"),
    Family("state_trace", state_trace, {"haystack": "repeat", "num_updates": 8, "num_distractors": 1},
           {"haystack": HAYSTACKS}, "long output: every value one counter held, first to last"),
    Family("system_rules", system_rules, {"value_kind": "number", "num_requests": 4, "num_distractors": 4},
           {"value_kind": _KINDS}, "long system prompt of tools and rules, shared by independent requests",
           system_prompt=True),
)}


def resolve_families(names: Sequence[str] | str) -> list[str]:
    """Expand ``"all"`` and check names; an unknown one raises ValueError naming the valid ones."""
    if isinstance(names, str):
        names = [names]
    out: list[str] = []
    for name in names:
        expanded = list(FAMILIES) if name == "all" else [name]
        for n in expanded:
            if n not in FAMILIES:
                raise UsageError(f"unknown probe family {n!r}; valid families: {', '.join(FAMILIES)}, all")
            if n not in out:
                out.append(n)
    return out


def _tokenizer_name(tokenizer) -> str:
    return str(getattr(tokenizer, "kveval_name", None) or getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def _check_depths(depths: Sequence[float]) -> list[float]:
    out = []
    for d in depths:
        d = float(d)
        if not 0.0 <= d <= 1.0:
            raise UsageError(f"depth {d} is outside [0, 1]")
        out.append(d)
    if not out:
        raise UsageError("give at least one depth")
    return out


def generate_items(family: str, tokenizer, length: int, n: int, depths: Sequence[float] | float | None = None,
                   seed: int = 0, **params: Any) -> list[ProbeItem]:
    """Generate ``n`` probe items of one family at one prompt length.

    Parameters
    ----------
    family : str
        A key of :data:`FAMILIES`.
    tokenizer : tokenizer or str
        The model's tokenizer (:func:`kveval.modeling.sources.load_tokenizer` loads one by name).
        Lengths and spans are counted with it, chat template included when it has one.
    length : int
        Target prompt length in tokens; every prompt has ``length * (1 - 0.02) <= tokens <= length``
        (``multi_turn``: the last turn; earlier turns are shorter by their missing history).
    n : int
        Number of contexts; item ``i`` gets depth ``depths[i % len(depths)]``.
        ``multi_turn`` yields ``num_turns`` items per context.
    depths : float or sequence of float, optional
        Relative needle depths in [0, 1]; default 0, 0.25, 0.5, 0.75, 1.
    seed : int
        Item ``i`` is drawn from ``random.Random(f"kveval-probes|{family}|s{seed}|{i}")``, so the
        same index holds the same keys and values at every length and depth.
    **params
        Family parameters (see ``FAMILIES[family].defaults``).

    Returns
    -------
    list of ProbeItem
    """
    if family not in FAMILIES:
        resolve_families([family])
    fam = FAMILIES[family]
    p = fam.resolve(params)
    if isinstance(tokenizer, str):  # probes stand below the engine: they never load a model's files themselves
        raise TypeError(f"generate_items takes a tokenizer, not the name {tokenizer!r}: load it with "
                        f"kveval.modeling.sources.load_tokenizer")
    if not is_whole(length) or length <= 0:
        raise UsageError(f"length must be a positive number of tokens, not {length!r}")
    if not is_whole(n) or n < 0:
        raise UsageError(f"n must be a non-negative integer, not {n!r}")
    if depths is None:
        depths = DEFAULT_DEPTHS
    elif isinstance(depths, (int, float)):
        depths = [depths]
    depths = _check_depths(depths)
    frame = PromptFrame.for_system(tokenizer) if fam.system_prompt else PromptFrame.for_tokenizer(tokenizer)
    tok_name = _tokenizer_name(tokenizer)
    tag = fam.tag(p)
    items: list[ProbeItem] = []
    for index in range(n):
        depth = depths[index % len(depths)]
        rng = random.Random(f"kveval-probes|{family}|s{seed}|{index}")
        spec = fam.generator(rng, depth, p)
        items.extend(_realize(spec, fam, p, tokenizer, frame, tok_name, tag, length, depth, seed, index))
    return items


def _realize(spec: Spec, fam: Family, p: dict[str, Any], tokenizer, frame: PromptFrame, tok_name: str, tag: str,
             length: int, depth: float, seed: int, index: int) -> list[ProbeItem]:
    rendered = [frame.render("", t.question, t.answer_prefix)[1] for t in spec.turns]
    q_tokens = [len(encode_parts(tokenizer, "", r)[1]) for r in rendered]
    built = fit(spec.layout, frame, tokenizer, length - max(q_tokens))
    group = f"{tag}-{length}-{depth:.2f}-s{seed}-{index}"
    multi = len(spec.turns) > 1
    items = []
    for t, turn in enumerate(spec.turns):
        prompt_context, prompt_question = frame.render(built.context, turn.question, turn.answer_prefix)
        assert prompt_context == built.prompt_context
        gold, stale = set(turn.gold), set(turn.stale)
        needles = [Needle(pl.key, pl.value, "target" if pl.value in gold else "stale" if pl.value in stale else "distractor",
                          pl.token_span) for pl in built.placed]
        primary = next(pl for pl in built.placed if pl.value == turn.primary)
        gold_tokens = len(tokenizer(", ".join(turn.gold), add_special_tokens=False)["input_ids"])
        params = {"length": length, "seed": seed, "index": index, "tokenizer": tok_name, **p}
        if multi:
            params["num_turns"] = len(spec.turns)
        if fam.system_prompt:
            params["system_prompt"] = True
        items.append(ProbeItem(
            id=f"{group}-t{t}" if multi else group,
            hash=prompt_hash(prompt_context, prompt_question),
            family=fam.name,
            params=params,
            context=built.context,
            question=turn.question,
            prompt_context=prompt_context,
            prompt_question=prompt_question,
            gold=list(turn.gold),
            needles=needles,
            length=built.context_tokens + q_tokens[t],
            depth=turn.depth,
            depth_actual=round(built.depth_of(primary), 4),
            group=group,
            turn=t,
            max_new_tokens=max(gold_tokens + 16, math.ceil(spec.answer_room * gold_tokens)),
            answer_prefix=turn.answer_prefix,
            value_kind=spec.value_kind,
            scoring=spec.scoring,
        ))
    return items


@dataclass(frozen=True)
class Cell:
    """One (length, depth) cell of a needle-in-a-haystack heatmap."""

    length: int
    depth: float

    def __post_init__(self) -> None:
        if self.length <= 0:
            raise UsageError(f"cell length must be positive, not {self.length}")
        if not 0.0 <= self.depth <= 1.0:
            raise UsageError(f"cell depth {self.depth} is outside [0, 1]")

    def contains(self, item: ProbeItem) -> bool:
        return item.params.get("length") == self.length and abs(item.depth - self.depth) < 1e-9


def grid(lengths: Sequence[int], depths: Sequence[float] = DEFAULT_DEPTHS) -> Iterator[Cell]:
    """Cells of a length x depth heatmap, lengths outer, depths inner."""
    for length in lengths:
        for depth in _check_depths(depths):
            yield Cell(int(length), depth)


def generate_grid(family: str, tokenizer, lengths: Sequence[int], depths: Sequence[float] = DEFAULT_DEPTHS,
                  n_per_cell: int = 1, seed: int = 0, **params: Any) -> list[ProbeItem]:
    """Items for every :func:`grid` cell: ``n_per_cell`` contexts per (length, depth).

    Item ``i`` of every cell uses index ``i * len(depths) + j`` (``j`` the depth's
    position), so ids never repeat and cells at different lengths hold the same needles.
    """
    depths = _check_depths(depths)
    items: list[ProbeItem] = []
    for length in lengths:
        items.extend(generate_items(family, tokenizer, int(length), n_per_cell * len(depths), depths=depths,
                                    seed=seed, **params))
    return items
