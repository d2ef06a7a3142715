"""Haystack text, key and value generators for the recall probes.

Everything here is deterministic given a :class:`random.Random` instance; nothing
touches the global RNG.

Haystacks
---------
``repeat``
    The filler of Mohtashami & Jaggi (2023) and RULER: "The grass is green. The sky
    is blue. The sun is yellow. Here we go. There and back again." repeated.
``prose``
    Natural prose from ``data/prose.txt``: original essays written for kveval in a
    nineteenth-century style (dedicated to the public domain, CC0). It contains no
    digits, so the only numbers in a context come from needles. A seeded start
    sentence is drawn per item; the text cycles for very long contexts.
``needles``
    A haystack made only of distractor needles (RULER ``niah_multikey_2``); built
    by the family generators, not here.
"""

from __future__ import annotations

import functools
import random
import re
import uuid
from importlib import resources

from kveval.errors import UsageError

REPEAT_SENTENCES = (
    "The grass is green.",
    "The sky is blue.",
    "The sun is yellow.",
    "Here we go.",
    "There and back again.",
)

VALUE_KINDS = ("number", "word", "uuid")

# Key words: adjective-noun pairs such as "amber-falcon" (RULER uses such word keys).
KEY_ADJECTIVES = (
    "amber", "ancient", "bitter", "bold", "brave", "brisk", "calm", "clever", "crimson", "curious",
    "dusty", "eager", "early", "fancy", "fierce", "gentle", "gilded", "glossy", "golden", "grand",
    "hidden", "hollow", "humble", "icy", "idle", "jolly", "keen", "lively", "lofty", "loyal",
    "mellow", "misty", "modest", "noble", "odd", "pale", "plain", "polite", "proud", "quiet",
    "rapid", "rustic", "sandy", "scarlet", "shy", "silent", "silver", "sleepy", "smooth", "snowy",
    "solemn", "sturdy", "swift", "tender", "tidy", "velvet", "vivid", "wandering", "wary", "witty",
)
KEY_NOUNS = (
    "anchor", "badger", "barrel", "beacon", "bishop", "bramble", "bridge", "candle", "canyon", "castle",
    "cedar", "chapel", "compass", "cottage", "falcon", "ferry", "fiddle", "forge", "fountain", "glacier",
    "harbor", "hermit", "heron", "lantern", "ledger", "magnet", "marble", "meadow", "mill", "minstrel",
    "monk", "orchard", "otter", "parcel", "pebble", "pilgrim", "quarry", "raven", "saddle", "scholar",
    "shepherd", "signal", "spindle", "steeple", "thimble", "thistle", "tinker", "tower", "tunnel", "valley",
    "violin", "walrus", "weaver", "willow", "windmill", "wizard", "wren", "yeoman", "zephyr", "kettle",
)
# Word values: concrete nouns disjoint from the key vocabulary and absent from the prose text.
VALUE_WORDS = (
    "acorn", "almond", "apricot", "asparagus", "avocado", "bagpipe", "banjo", "biscuit", "blender", "bonsai",
    "boomerang", "broccoli", "buffalo", "cactus", "canoe", "caramel", "cashew", "catapult", "cello", "chameleon",
    "cinnamon", "clarinet", "coconut", "cricket", "crocodile", "cucumber", "cupcake", "dolphin", "dragonfly", "dumpling",
    "eggplant", "elephant", "emerald", "falafel", "flamingo", "gazelle", "giraffe", "gondola", "gorilla", "guitar",
    "hamster", "harmonica", "hamburger", "hippo", "iguana", "jaguar", "jellyfish", "kangaroo", "kayak", "kiwi",
    "koala", "lemonade", "lobster", "macaroni", "mango", "marmalade", "meerkat", "mushroom", "narwhal", "noodle",
    "octopus", "omelette", "ostrich", "paprika", "papaya", "peacock", "pelican", "penguin", "pepperoni", "piano",
    "pineapple", "pistachio", "platypus", "popcorn", "pretzel", "pumpkin", "raccoon", "radish", "raspberry", "rhubarb",
    "saxophone", "scooter", "seahorse", "skateboard", "sombrero", "spinach", "squirrel", "submarine", "tambourine", "toucan",
    "trombone", "tulip", "turnip", "ukulele", "umbrella", "vanilla", "waffle", "walnut", "xylophone", "zucchini",
    "accordion", "alpaca", "anteater", "armadillo", "artichoke", "baboon", "bagel", "balloon", "bamboo", "banana",
    "beetroot", "blueberry", "bobcat", "bongo", "brownie", "burrito", "butterscotch", "cabbage", "calculator", "camera",
    "cantaloupe", "cardigan", "carousel", "cauliflower", "cheetah", "chinchilla", "chipmunk", "chocolate", "cobra", "coyote",
    "cranberry", "croissant", "cymbal", "dandelion", "doughnut", "eclair", "escalator", "ferret", "flashlight", "frisbee",
    "gecko", "ginger", "gnocchi", "grapefruit", "guacamole", "harpsichord", "hazelnut", "helicopter", "hyena", "jackal",
    "jalapeno", "jukebox", "kazoo", "kumquat", "lasagna", "lemur", "lychee", "magnolia", "mandolin", "manatee",
    "marshmallow", "mongoose", "mosquito", "muffin", "nectarine", "nutmeg", "oboe", "okapi", "orangutan", "origami",
    "pancake", "panda", "parsnip", "persimmon", "piccolo", "pomegranate", "porcupine", "puffin", "quesadilla", "quokka",
    "ravioli", "robot", "saffron", "salamander", "sardine", "scorpion", "sitar", "skunk", "spaghetti", "stapler",
    "sunflower", "tangerine", "tapir", "toboggan", "tortilla", "trampoline", "tuba", "vulture", "wombat", "yogurt",
)

_UPPER = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"


@functools.lru_cache(maxsize=1)
def prose_sentences() -> tuple[str, ...]:
    """Sentences of the shipped prose haystack, in order (comment lines skipped)."""
    text = resources.files("kveval.probes").joinpath("data/prose.txt").read_text(encoding="utf-8")
    body = " ".join(line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))
    sentences = re.split(r"(?<=[.!?;])\s+(?=[A-Z])", body)
    return tuple(s.strip() for s in sentences if s.strip())


class SentenceStream:
    """Endless haystack sentences: ``repeat`` cycles the filler, ``prose`` cycles the essays from a seeded start."""

    def __init__(self, kind: str, rng: random.Random):
        if kind == "repeat":
            self._base: tuple[str, ...] = REPEAT_SENTENCES
            self._start = 0
        elif kind == "prose":
            self._base = prose_sentences()
            self._start = rng.randrange(len(self._base))
        else:
            raise UsageError(f"unknown sentence haystack {kind!r}; use repeat or prose")

    def __getitem__(self, index: int) -> str:
        return self._base[(self._start + index) % len(self._base)]


class UniqueDraw:
    """Draw keys and values without repetition within one item.

    Values of one kind have one shape and are parsed as whole tokens by the
    scorer, so distinctness is all that is needed (no substring checks).
    """

    def __init__(self, rng: random.Random):
        self.rng = rng
        self.used: set[str] = set()

    def _unique(self, make, what: str) -> str:
        for _ in range(1000):
            value = make()
            if value not in self.used:
                self.used.add(value)
                return value
        raise UsageError(f"ran out of distinct {what} for one item; ask for a shorter context or fewer needles "
                         f"(or value_kind=number / uuid for long haystacks of needles)")

    def key(self) -> str:
        """An adjective-noun key such as ``"amber-falcon"`` (adjective-adjective-noun once those run short)."""
        for _ in range(50):
            key = f"{self.rng.choice(KEY_ADJECTIVES)}-{self.rng.choice(KEY_NOUNS)}"
            if key not in self.used:
                self.used.add(key)
                return key
        return self._unique(lambda: f"{self.rng.choice(KEY_ADJECTIVES)}-{self.rng.choice(KEY_ADJECTIVES)}-"
                                    f"{self.rng.choice(KEY_NOUNS)}", "keys")

    def number(self, digits: int = 7) -> str:
        """A decimal number with exactly ``digits`` digits (no leading zero)."""
        return self._unique(lambda: str(self.rng.randrange(10 ** (digits - 1), 10**digits)), "numbers")

    def word(self) -> str:
        return self._unique(lambda: self.rng.choice(VALUE_WORDS), "words")

    def uuid(self) -> str:
        """A version-4 UUID drawn from the item's RNG (lowercase, 36 characters)."""
        return self._unique(lambda: str(uuid.UUID(int=self.rng.getrandbits(128), version=4)), "UUIDs")

    def variable(self, letters: int = 5) -> str:
        """A variable name of ``letters`` uppercase letters (``"QWERT"``)."""
        return self._unique(lambda: "".join(self.rng.choice(_UPPER) for _ in range(letters)), "variable names")

    def value(self, kind: str) -> str:
        if kind == "number":
            return self.number(7)
        if kind == "word":
            return self.word()
        if kind == "uuid":
            return self.uuid()
        raise UsageError(f"unknown value kind {kind!r}; use one of {', '.join(VALUE_KINDS)}")


def kind_noun(kind: str, plural: bool = False) -> str:
    """RULER's name for a value kind in needle wording: number(s), word(s), UUID(s)."""
    noun = {"number": "number", "word": "word", "uuid": "UUID"}[kind]
    return noun + "s" if plural else noun
