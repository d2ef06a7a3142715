"""Policy base classes, the registry, and the spec-string parser.

A *policy* is a small validated config object. Three families stack, applied in
this order to the tokens of a sequence:

1. selection (which tokens stay): ``window``, ``streaming``, ``h2o``, ``snapkv``, ...
2. structure (how each kept token is represented): ``lowrank``
3. quantization (how the stored numbers are encoded): ``quant``, ``kivi``, ``fp8``

Spec strings are what users type, e.g. ``snapkv(ratio=0.5)+kivi(bits=4)``:
``name(key=value, ...)`` terms joined by ``+``, at most one per family.
"""

from __future__ import annotations

import ast
import math
import re
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, ClassVar

if TYPE_CHECKING:
    import torch

POLICIES: dict[str, type["Policy"]] = {}

FAMILY_ORDER = ("selection", "structure", "quantization")


def register_policy(cls: type["Policy"]) -> type["Policy"]:
    """Class decorator: make a policy available to :func:`parse_policy` under ``cls.name``."""
    POLICIES[cls.name] = cls
    return cls


@dataclass
class Policy:
    """Base of every policy. Subclasses are dataclasses whose fields are the spec parameters."""

    name: ClassVar[str] = ""
    family: ClassVar[str] = ""
    description: ClassVar[str] = ""

    def spec(self) -> str:
        """Canonical spec string: the first parameter, then those that differ from their defaults, in field order."""
        parts = []
        for i, f in enumerate(fields(self)):
            value = getattr(self, f.name)
            if value is not None and (i == 0 or value != f.default):
                parts.append(f"{f.name}={value:g}" if isinstance(value, float) else f"{f.name}={value}")
        return f"{self.name}({','.join(parts)})" if parts else self.name


@dataclass
class SelectionPolicy(Policy):
    """Keeps a subset of the context's tokens.

    ``ratio`` is the fraction of context KV pairs removed (0 <= ratio < 1);
    ``budget`` is the alternative: the number of context tokens kept. Give one.
    Subclasses say which attention they need to score tokens (``attention``):
    ``"none"`` (scores from keys alone, or no scores), ``"window"`` (the last
    ``window`` queries of the prefill), ``"all"`` (every query), ``"last"``
    (the most recent query).
    """

    family: ClassVar[str] = "selection"
    attention: ClassVar[str] = "none"
    supports_decode_budget: ClassVar[bool] = True
    decode_budget = None  # tokens the cache may hold while decoding; None lets it grow

    def keep_count(self, n_tokens: int, layer_idx: int = 0, num_layers: int = 1) -> int:
        """How many of ``n_tokens`` context tokens to keep in layer ``layer_idx``."""
        raise NotImplementedError

    def scores(self, state: "ScoringState") -> "torch.Tensor":
        """Per KV head and token, higher = more worth keeping; shape ``[kv_heads, tokens]``."""
        raise NotImplementedError

    @property
    def nominal_ratio(self) -> float | None:
        return getattr(self, "ratio", None)


@dataclass
class RatioSelectionPolicy(SelectionPolicy):
    """A selection policy sized by ``ratio`` or ``budget``, with an optional ``decode_budget``.

    Attributes
    ----------
    ratio : float, optional
        Fraction of context KV pairs removed, ``0 <= ratio < 1``.
    budget : int, optional
        Absolute number of context tokens kept (instead of ``ratio``).
    decode_budget : int, optional
        While decoding, the cache never holds more than this many tokens
        (context and generated together); ``None`` lets it grow.
    """

    ratio: float | None = None
    budget: int | None = None
    decode_budget: int | None = None

    def __post_init__(self):
        if (self.ratio is None) == (self.budget is None):
            raise ValueError(f"{self.name}: give exactly one of ratio= (fraction removed, 0 <= ratio < 1) or budget= (tokens kept)")
        if self.ratio is not None and not 0 <= self.ratio < 1:
            raise ValueError(f"{self.name}: ratio={self.ratio} is out of range; ratio is the fraction of context KV pairs removed, 0 <= ratio < 1")
        if self.budget is not None and self.budget < 1:
            raise ValueError(f"{self.name}: budget={self.budget} must be a positive number of tokens")
        if self.decode_budget is not None:
            if not self.supports_decode_budget:
                raise ValueError(f"{self.name}: decode_budget is not supported (its scores come from the prefill only); use h2o, tova, knorm or random")
            if self.decode_budget < 1:
                raise ValueError(f"{self.name}: decode_budget={self.decode_budget} must be a positive number of tokens")

    def keep_count(self, n_tokens: int, layer_idx: int = 0, num_layers: int = 1) -> int:
        if self.budget is not None:
            return min(self.budget, n_tokens)
        return min(n_tokens, max(1, math.ceil((1 - self.ratio) * n_tokens)))


@dataclass
class ScoringState:
    """What a selection policy may look at for one sequence in one layer.

    Attributes
    ----------
    keys : torch.Tensor
        Stored keys (dequantized), ``[kv_heads, tokens, head_dim]``, after RoPE.
    positions : torch.Tensor
        Original sequence position of every stored token, ``[kv_heads, tokens]``.
    attention : torch.Tensor or None
        Attention mass each token received from the queries the policy asked
        for (``SelectionPolicy.attention``), summed over those queries and
        averaged over the query heads that share each KV head (GQA/MQA),
        ``[kv_heads, tokens]``; ``None`` for ``attention == "none"``.
    layer_idx, num_layers : int
        Which layer this is, for layer-dependent budgets.
    seed : int
        Per-sequence seed for the ``random`` control.
    """

    keys: "torch.Tensor"
    positions: "torch.Tensor"
    attention: "torch.Tensor | None"
    layer_idx: int
    num_layers: int
    seed: int = 0


@dataclass
class RepresentationPolicy(Policy):
    """Changes how kept tokens are stored (structure or quantization)."""


_TERM = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:\((.*)\))?\s*$", re.S)


def _parse_value(text: str):
    text = text.strip()
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    if text.lower() in ("none", "null"):
        return None
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text.strip("'\"")


def _split_terms(spec: str) -> list[str]:
    """Split on ``+`` outside parentheses."""
    terms, depth, start = [], 0, 0
    for i, ch in enumerate(spec):
        depth += ch == "("
        depth -= ch == ")"
        if ch == "+" and depth == 0:
            terms.append(spec[start:i])
            start = i + 1
    terms.append(spec[start:])
    return terms


def parse_term(term: str) -> Policy:
    """Parse one ``name(key=value, ...)`` term into a validated policy object."""
    match = _TERM.match(term)
    if not match:
        raise ValueError(f"cannot parse policy term {term.strip()!r}; write it as name(key=value, ...), e.g. window(size=256)")
    name, args = match.group(1).lower(), match.group(2)
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; known policies: {', '.join(sorted(POLICIES))} (see `kveval policies`)")
    cls = POLICIES[name]
    valid = [f.name for f in fields(cls)]
    kwargs = {}
    if args and args.strip():
        for i, part in enumerate(args.split(",")):
            if "=" not in part:
                if i == 0 and len(valid) >= 1:  # one positional argument: the first field, e.g. window(64)
                    kwargs[valid[0]] = _parse_value(part)
                    continue
                raise ValueError(f"{name}: argument {part.strip()!r} needs a name; parameters: {', '.join(valid) or 'none'}")
            key, value = part.split("=", 1)
            key = key.strip()
            if key not in valid:
                raise ValueError(f"{name} has no parameter {key!r}; parameters: {', '.join(valid) or 'none'}")
            kwargs[key] = _parse_value(value)
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ValueError(f"{name}: {exc}") from exc


@dataclass
class PolicyStack:
    """At most one policy of each family, applied selection -> structure -> quantization.

    ``PolicyStack()`` (all ``None``) is the uncompressed baseline, spec ``none``.
    """

    selection: SelectionPolicy | None = None
    structure: RepresentationPolicy | None = None
    quantization: RepresentationPolicy | None = None

    @property
    def spec(self) -> str:
        terms = [p.spec() for p in (self.selection, self.structure, self.quantization) if p is not None]
        return "+".join(terms) if terms else "none"

    @property
    def label(self) -> str:
        """Label for plots, one line per label: the spec without the selection's size, e.g. ``snapkv+kivi(bits=4)``."""
        terms = []
        for p in (self.selection, self.structure, self.quantization):
            if p is None:
                continue
            terms.append(p.name if isinstance(p, RatioSelectionPolicy) else p.spec())
        return "+".join(terms) if terms else "none"

    @property
    def ratio(self) -> float | None:
        return self.selection.nominal_ratio if self.selection is not None else None

    @property
    def is_none(self) -> bool:
        return self.selection is None and self.structure is None and self.quantization is None

    def __str__(self) -> str:
        return self.spec


def parse_policy(spec: "str | PolicyStack | None") -> PolicyStack:
    """Parse a spec string such as ``"snapkv(ratio=0.5)+kivi(bits=4)"``.

    Raises
    ------
    ValueError
        One line naming the problem: unknown policy or parameter, value out of
        range, or two policies of the same family.
    """
    if isinstance(spec, PolicyStack):
        return spec
    if spec is None or not str(spec).strip():
        return PolicyStack()
    stack = PolicyStack()
    for term in _split_terms(str(spec)):
        if not term.strip():
            raise ValueError(f"empty term in policy spec {spec!r}; join policies with a single '+'")
        policy = parse_term(term)
        if policy.family == "none":
            continue
        if getattr(stack, policy.family) is not None:
            raise ValueError(f"policy spec {spec!r} has two {policy.family} policies; stack at most one each of {', '.join(FAMILY_ORDER)}")
        setattr(stack, policy.family, policy)
    return stack
