"""Policy base classes, the registry, and the spec-string parser.

A *policy* is a small validated config object. Three families stack, applied in
this order to the tokens of a sequence:

1. selection (which tokens stay): ``window``, ``streaming``, ``h2o``, ``snapkv``, ...
2. structure (how each kept token is represented): ``lowrank``
3. quantization (how the stored numbers are encoded): ``quant``, ``kivi``, ``fp8``

Spec strings are what users type, e.g. ``snapkv(ratio=0.5)+kivi(bits=4)``:
``name(key=value, ...)`` terms joined by ``+``, at most one per family. Every
parameter has a declared type (its dataclass annotation: ``bool``, ``int``,
``float`` or ``str``, optionally ``None``); a value of another type, an unknown
or repeated parameter is one :class:`~kveval.errors.PolicySpecError` line.
The canonical spec (:attr:`PolicyStack.spec`) parses back to the same stack.
"""

from __future__ import annotations

import ast
import math
import re
import types
import typing
from dataclasses import MISSING, dataclass, fields
from typing import TYPE_CHECKING, ClassVar

from kveval.errors import PolicySpecError
from kveval.values import is_real

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
    given: ClassVar[frozenset[str] | None] = None  # set per object by the parser: the parameters the spec named

    def is_given(self, param: str) -> bool:
        """Whether the spec set ``param`` (built from Python: whether it differs from its default)."""
        if self.given is not None:
            return param in self.given
        default = next(f.default for f in fields(self) if f.name == param)
        return getattr(self, param) != default

    def spec(self) -> str:
        """Canonical spec string: the first parameter, then those that differ from their defaults, in field order."""
        parts = []
        for i, f in enumerate(fields(self)):
            value = getattr(self, f.name)
            if value is not None and (i == 0 or value != f.default):
                parts.append(f"{f.name}={_format(value)}")
        return f"{self.name}({','.join(parts)})" if parts else self.name


def _format(value) -> str:
    """A parameter value as spec text that parses back to the same value."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


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
    #: :meth:`scores` also takes a whole batch: the state's tensors may carry leading row dimensions
    #: (``[rows, kv_heads, tokens]``), and each row's scores depend on that row alone, as they would for the row
    #: by itself. The cache then keeps a decode budget for the batch at once (:mod:`kveval.buffered_decode`).
    batch_scores: ClassVar[bool] = False
    #: With ``batch_scores``, :meth:`scores` reads the state's positions and attention alone (never its keys, layer,
    #: seed or model): the decode budgets of a forward's layers may then be scored at once, on their rows stacked
    #: (:class:`kveval.decode_evictions.DeferredEvictions`).
    scores_stack_layers: ClassVar[bool] = False

    def keep_count(self, n_tokens: int, layer_idx: int = 0, num_layers: int = 1) -> int:
        """How many of ``n_tokens`` context tokens to keep in layer ``layer_idx``."""
        raise NotImplementedError

    def scores(self, state: "ScoringState") -> "torch.Tensor":
        """Per KV head and token, higher = more worth keeping; shape ``[kv_heads, tokens]``."""
        raise NotImplementedError

    @property
    def per_head_budgets(self) -> bool:
        """Whether KV heads of one layer may keep different numbers of tokens (the cache then stores each head apart)."""
        return False

    def head_decode_budgets(self, model, layer_idx: int, num_layers: int, kv_heads: int) -> "list[int | None] | None":
        """With :attr:`per_head_budgets` and a ``decode_budget``: the tokens each KV head of layer ``layer_idx``
        keeps while decoding, when that is a fixed count per head (``None`` for a head that keeps every token)
        and :meth:`choose` keeps each head's best-scored tokens up to it. ``None`` (the default) when the
        counts depend on the scores (AdaKV's shared budget: see :meth:`choose_batch`)."""
        return None

    @property
    def chooses_in_batch(self) -> bool:
        """Whether :meth:`choose_batch` serves this policy's per-head decode budget (else rows decode one by one)."""
        return False

    def choose_batch(self, scores: "torch.Tensor", keep: int) -> "torch.Tensor":
        """:meth:`choose` for a whole batch, where per-head counts depend on the scores (:attr:`chooses_in_batch`).

        ``scores`` is ``[B, kv_heads, slots]`` (``-inf`` on padding slots); returns the boolean ``[B, kv_heads,
        slots]`` of kept slots: for every row, the slots ``choose`` would keep for it alone.
        """
        raise NotImplementedError

    def choose(self, scores: "torch.Tensor", keep: int, state: "ScoringState",
               stable: bool = False) -> "torch.Tensor | list[torch.Tensor]":
        """Which tokens each KV head keeps, given ``scores`` (``[kv_heads, n]``, ``-inf`` on padding slots).

        ``keep`` is the per-head budget (:meth:`keep_count`). Returns ``[kv_heads, keep]``
        increasing indices (every head keeps ``keep``), or, when :attr:`per_head_budgets`,
        one increasing index tensor per head. ``stable``: equal scores ranked in slot order
        (:func:`best_first`), as every decode eviction ranks them (see :func:`top_slots`).
        """
        return top_slots(scores, keep, dim=1, stable=stable)

    @property
    def nominal_ratio(self) -> float | None:
        return getattr(self, "ratio", None)


#: AdaKV's safeguard default (Feng et al. 2024 use alpha = 0.2 of each head's even share).
ADAKV_FLOOR = 0.2


def best_first(scores: "torch.Tensor", dim: int = -1) -> "torch.Tensor":
    """Indices along ``dim``, the best score first and equal scores in slot order (a stable sort).

    Decode evictions rank by this order, row by row and in batch alike, so a row keeps the same tokens alone and
    in a batch, where it is padded to the batch's width (padding scores ``-inf`` and ranks last), even where
    scores tie: H2O scores its recent tokens ``+inf`` (all of them tie under a budget below ``recent``), and max
    pooling gives neighbours one score. ``topk`` leaves the order of equal scores to its kernel, which differs
    with the width: such a row kept other tokens in a batch than alone.
    """
    return scores.argsort(dim=dim, descending=True, stable=True)


def best_indices(scores: "torch.Tensor", count: int, dim: int = -1, stable: bool = True) -> "torch.Tensor":
    """The indices of the ``count`` best scores along ``dim``, best first: by :func:`best_first` (``stable``) or by
    ``topk`` (its own order of equal scores)."""
    if stable:
        return best_first(scores, dim).narrow(dim, 0, count)
    return scores.topk(count, dim=dim).indices


def top_slots(scores: "torch.Tensor", keep: int, dim: int = -1, stable: bool = True) -> "torch.Tensor":
    """The ``keep`` best slots along ``dim`` (:func:`best_indices`), in increasing slot order.

    A prefill ranks each row alone, at its own width whatever its batch, by ``topk`` (``stable=False``): its order
    of equal scores is then the same in any batch, and runs kept what they kept. A decode eviction ranks stably.
    """
    return best_indices(scores, keep, dim, stable).sort(dim=dim).values


def adaptive_choice(scores: "torch.Tensor", keep: int, floor: float, stable: bool = False) -> "list[torch.Tensor]":
    """AdaKV's allocation: ``keep x heads`` tokens chosen by score across all heads of a layer.

    Each head first keeps its top ``max(1, floor(floor x keep))`` tokens (the
    paper's fair-guaranteed safeguard); the rest of the layer's budget goes
    to the best scores over the flattened ``[heads, tokens]`` scores. Padding
    slots (``-inf``) are never kept; the budget shrinks to the real tokens
    there are. Returns one increasing index tensor per head. ``stable``: ranked by :func:`best_first` (decode
    evictions; :func:`adaptive_choice_batch` ranks so), else by ``topk`` (a prefill, each row alone).
    """
    import torch

    heads, n = scores.shape
    real = scores > float("-inf")
    total = min(keep * heads, int(real.sum()))
    safe = min(n, max(1, math.floor(floor * keep)))
    guaranteed = torch.zeros_like(real).scatter_(1, best_indices(scores, safe, 1, stable), True) & real
    ranked = scores.masked_fill(guaranteed, float("inf"))
    chosen = torch.zeros(heads * n, dtype=torch.bool, device=scores.device)
    chosen[best_indices(ranked.flatten(), total, 0, stable)] = True
    return [row.nonzero().squeeze(1) for row in chosen.reshape(heads, n)]


def adaptive_choice_batch(scores: "torch.Tensor", keep: int, floor: float) -> "torch.Tensor":
    """:func:`adaptive_choice` (``stable``: the decode eviction's ranking) for every row of ``[B, heads, slots]``
    scores at once: the boolean kept mask.

    Rows differ in how many real tokens they hold: one ranking (:func:`best_first`) of the flattened scores, of
    which each row keeps its own total's first.
    """
    import torch

    batch, heads, n = scores.shape
    real = scores > float("-inf")
    counts = real.sum(dim=2)  # [B, heads]
    total = counts.sum(dim=1)  # [B]
    safe = min(n, max(1, math.floor(floor * keep)))
    few = _adaptive_few_drops(scores, real, counts, total, keep * heads, safe)
    if few is not None:
        return few
    total = total.clamp(max=keep * heads)
    guaranteed = torch.zeros_like(real).scatter_(2, best_indices(scores, safe, 2), True) & real
    ranked = scores.masked_fill(guaranteed, float("inf")).reshape(batch, heads * n)
    most = min(keep * heads, heads * n)
    best = best_indices(ranked, most, 1)  # [B, most]: padding (-inf) ranks last, so each row's real tokens first
    own = torch.arange(most, device=scores.device)[None, :] < total[:, None]  # each row's first total[b]
    return torch.zeros_like(ranked, dtype=torch.bool).scatter_(1, best, own).reshape(batch, heads, n)


#: Most tokens a row may be over AdaKV's budget for :func:`_adaptive_few_drops` to find them by one ``topk``.
FEW_DROPS = 64


def _adaptive_few_drops(scores: "torch.Tensor", real: "torch.Tensor", counts: "torch.Tensor", total: "torch.Tensor",
                        budget: int, safe: int) -> "torch.Tensor | None":
    """:func:`adaptive_choice_batch`'s kept mask where a decode step leaves it nothing to rank: each row over
    ``budget`` by ``e`` tokens (at most :data:`FEW_DROPS`) drops its ``e`` lowest scores, found by one ``topk``.

    A decode step appends one token to every head, so a row at the budget comes back ``heads`` over. The ranking
    keeps each head's ``safe`` best (guaranteed), then the best of the rest: it drops exactly the ``e`` lowest
    where they are told apart from the others (the ``e``-th lowest below the next, so the order of equal scores
    cannot matter) and none of them is guaranteed (a head losing ``d`` tokens keeps at least ``safe``, all above
    the dropped ones). ``None`` where the ranking must decide: a tie at that boundary, a NaN, a guaranteed token
    among the lowest, or a row more than :data:`FEW_DROPS` over. ``counts``: each head's real tokens
    (``[B, heads]``); ``total``: each row's (``[B]``)."""
    import torch

    batch, heads, n = scores.shape
    excess = (total - budget).clamp(min=0)  # [B]
    flat = scores.reshape(batch, heads * n)
    most = int(excess.max())
    if most == 0:
        return real.clone()
    if most > FEW_DROPS or most + 1 > heads * n:
        return None
    # The e + 1 lowest real scores of each row, ascending (padding never among them: +inf, above any real score
    # but an +inf one, and a tie with that is no boundary).
    lowest, slots = flat.masked_fill(~real.reshape(batch, -1), float("inf")).topk(most + 1, dim=1, largest=False)
    at = excess[:, None]
    told_apart = lowest.gather(1, (at - 1).clamp(min=0)) < lowest.gather(1, at)  # [B, 1]
    dropped = torch.zeros_like(flat, dtype=torch.bool).scatter_(
        1, slots, torch.arange(most + 1, device=scores.device)[None, :] < at)
    lost = dropped.view(batch, heads, n).sum(dim=2)  # [B, heads]
    unclear = (excess > 0) & ~told_apart.squeeze(1)
    unclear |= ((lost > 0) & (counts - lost < safe)).any(dim=1) | flat.isnan().any(dim=1)
    if bool(unclear.any()):
        return None
    return (real.reshape(batch, -1) & ~dropped).view(batch, heads, n)


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
        (context and generated together); ``None`` lets it grow. With
        ``adaptive``, a per-head average: the layer holds ``decode_budget x kv_heads``.
    adaptive : bool
        AdaKV (Feng et al. 2024, "Ada-KV: Optimizing KV Cache Eviction by
        Adaptive Budget Allocation for Efficient LLM Inference"): the layer's
        budget (tokens kept x KV heads) is redistributed across its heads by
        score, top over the flattened ``[heads, tokens]`` scores, so heads keep
        different numbers of tokens (stored apart: :mod:`kveval.head_stores`).
        Stacks with quantization, not with a structure policy.
    floor : float
        AdaKV's safeguard: each head keeps at least this fraction of its even
        share (``keep``) by its own top scores; 0.2 as in the paper.
    """

    ratio: float | None = None
    budget: int | None = None
    decode_budget: int | None = None
    adaptive: bool = False
    floor: float = ADAKV_FLOOR

    #: Scores identical across the heads of a layer (TOVA): adaptive budgets would change nothing.
    head_shared_scores: ClassVar[bool] = False

    def __post_init__(self):
        if self.adaptive and self.head_shared_scores:
            raise PolicySpecError(f"{self.name}: adaptive=true changes nothing (its scores are the same for every head); drop it")
        if not 0 <= self.floor <= 1:
            raise PolicySpecError(f"{self.name}: floor={self.floor} must be in [0, 1] (fraction of a head's even share it always keeps)")
        if (self.ratio is None) == (self.budget is None):
            raise PolicySpecError(f"{self.name}: give exactly one of ratio= (fraction removed, 0 <= ratio < 1) or budget= (tokens kept)")
        check_ratio(self.name, self.ratio)
        if self.budget is not None and self.budget < 1:
            raise PolicySpecError(f"{self.name}: budget={self.budget} must be a positive number of tokens")
        if self.decode_budget is not None:
            if not self.supports_decode_budget:
                raise PolicySpecError(f"{self.name}: decode_budget is not supported (its scores come from the prefill only); use h2o, tova, knorm or random")
            if self.decode_budget < 1:
                raise PolicySpecError(f"{self.name}: decode_budget={self.decode_budget} must be a positive number of tokens")

    def keep_count(self, n_tokens: int, layer_idx: int = 0, num_layers: int = 1) -> int:
        if self.budget is not None:
            return min(self.budget, n_tokens)
        return ratio_keep_count(self.ratio, n_tokens)

    @property
    def per_head_budgets(self) -> bool:
        return self.adaptive

    def choose(self, scores: "torch.Tensor", keep: int, state: "ScoringState",
               stable: bool = False) -> "torch.Tensor | list[torch.Tensor]":
        if self.adaptive:
            return adaptive_choice(scores, keep, self.floor, stable)
        return super().choose(scores, keep, state, stable)

    @property
    def chooses_in_batch(self) -> bool:
        return self.adaptive

    def choose_batch(self, scores: "torch.Tensor", keep: int) -> "torch.Tensor":
        return adaptive_choice_batch(scores, keep, self.floor)


def ratio_keep_count(ratio: float, n_tokens: int) -> int:
    """Tokens kept of ``n_tokens`` when the fraction ``ratio`` is removed: ``ceil((1 - ratio) * n)``, at least 1.

    Every selection policy sized by ``ratio`` keeps this many, so policies at
    one ratio always hold the same number of tokens.
    """
    return min(n_tokens, max(1, math.ceil((1 - ratio) * n_tokens)))


def check_ratio(name: str, ratio: float | None) -> None:
    if ratio is not None and not 0 <= ratio < 1:
        raise PolicySpecError(f"{name}: ratio={ratio} is out of range; ratio is the fraction of context KV pairs removed, 0 <= ratio < 1")


@dataclass
class ScoringState:
    """What a selection policy may look at for one sequence in one layer.

    Attributes
    ----------
    keys : torch.Tensor or None
        Stored keys (dequantized), ``[kv_heads, tokens, head_dim]``, after RoPE; ``None`` for a policy that
        declares it never reads them (``scores_stack_layers``).
    positions : torch.Tensor
        Original sequence position of every stored token, ``[kv_heads, tokens]``.
    attention : torch.Tensor or None
        Attention mass each token received from the queries the policy asked
        for (``SelectionPolicy.attention``), summed over those queries and
        averaged over the query heads that share each KV head (GQA/MQA),
        ``[kv_heads, tokens]``; ``None`` for ``attention == "none"``.
    layer_idx, num_layers : int
        Which layer this is, for layer-dependent budgets.
    seed : int or tuple of int
        Per-sequence seed for the ``random`` control (one per row for a batch: see ``batch_scores``).
    model : PreTrainedModel or None
        The model the cache serves, for policies calibrated per model (``duo``).

    With per-head budgets, heads may hold fewer tokens than the slots shown:
    their padding slots have zero keys, zero attention and position ``-1``,
    and whatever a policy scores them is replaced by ``-inf``.
    """

    keys: "torch.Tensor | None"
    positions: "torch.Tensor"
    attention: "torch.Tensor | None"
    layer_idx: int
    num_layers: int
    seed: "int | tuple[int, ...]" = 0
    model: object = None


@dataclass
class RepresentationPolicy(Policy):
    """Changes how kept tokens are stored (structure or quantization): the interface the cache and runner use.

    The cache builds one store per sequence and layer, innermost first:
    ``quantization.make_store(DenseStore(kv_dtype, compute_dtype), ...)`` then
    ``structure.make_store(that, ...)``. The runner calls :meth:`prepare` once
    per model before the first forward pass and records :meth:`run_info` in
    ``run.json``.
    """

    def make_store(self, inner, model, layer_idx: int):
        """The store of one sequence in layer ``layer_idx``, wrapping or replacing ``inner`` (keeping its dtypes)."""
        raise NotImplementedError(f"{type(self).__name__} must define make_store")

    def prepare(self, model) -> None:
        """Work done once per model before the first forward pass (e.g. calibration). Default: nothing."""

    def run_info(self, model) -> dict:
        """What a run must record to be reproduced (e.g. the calibration used). Default: nothing."""
        return {}

    def stored_widths(self, head_dim: int) -> dict[str, int] | None:
        """Numbers per token and KV head this representation hands the next one, for K and V.

        ``None`` when they are only known after calibration (e.g. ranks chosen by energy).
        """
        return {"k": head_dim, "v": head_dim}


_TERM = re.compile(r"^\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:\((.*)\))?\s*$", re.S)

_TYPE_WORDS = {bool: "true or false", int: "an integer", float: "a number", str: "a word"}


@dataclass(frozen=True)
class ParamType:
    """The declared type of one policy parameter: ``bool``, ``int``, ``float`` or ``str``, optionally ``None``."""

    base: type
    optional: bool

    @classmethod
    def of(cls, annotation) -> "ParamType":
        args = typing.get_args(annotation)
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):
            rest = [a for a in args if a is not type(None)]
            if len(rest) != 1 or rest[0] not in _TYPE_WORDS:
                raise TypeError(f"unsupported parameter type {annotation!r}")
            return cls(rest[0], True)
        if annotation not in _TYPE_WORDS:
            raise TypeError(f"unsupported parameter type {annotation!r}")
        return cls(annotation, False)

    def describe(self) -> str:
        return _TYPE_WORDS[self.base] + (" or none" if self.optional else "")

    def convert(self, value):
        """Convert spec text (or an already typed value) to this type; raise ``ValueError`` if it is not one."""
        if isinstance(value, str):
            text = value.strip()
            if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"":
                text = text[1:-1]
                if self.base is str:
                    return text
            if text.lower() in ("none", "null"):
                if self.optional:
                    return None
                raise ValueError
            if self.base is str:
                if not text:
                    raise ValueError
                return text
            if self.base is bool:
                if text.lower() not in ("true", "false"):
                    raise ValueError
                return text.lower() == "true"
            try:
                value = ast.literal_eval(text)
            except (ValueError, SyntaxError):
                raise ValueError from None
        if value is None and self.optional:
            return None
        if self.base is bool:
            if isinstance(value, bool):
                return value
            raise ValueError
        if isinstance(value, bool):  # True is an int to Python, not to a spec
            raise ValueError
        if self.base is int and isinstance(value, int):
            return value
        if self.base is float and is_real(value):
            return float(value)
        if self.base is str and isinstance(value, str):
            return value
        raise ValueError


def param_types(cls: type["Policy"]) -> dict[str, ParamType]:
    """Declared type of every spec parameter of a policy class, in field order."""
    hints = typing.get_type_hints(cls)
    return {f.name: ParamType.of(hints[f.name]) for f in fields(cls)}


def param_defaults(cls: type["Policy"]) -> dict[str, object]:
    """Default of every spec parameter (``None`` where it has none)."""
    return {f.name: (None if f.default is MISSING else f.default) for f in fields(cls)}


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
    """Parse one ``name(key=value, ...)`` term into a validated policy object.

    Every value is converted to its parameter's declared type (``bool``:
    ``true``/``false`` only; ``int``: integers only; ``float``: any number;
    ``none`` where the parameter is optional). Anything else, an unknown or
    repeated parameter, or a value out of range raises :class:`PolicySpecError`.
    """
    match = _TERM.match(term)
    if not match:
        raise PolicySpecError(f"cannot parse policy term {term.strip()!r}; write it as name(key=value, ...), e.g. window(size=256)")
    name, args = match.group(1).lower(), match.group(2)
    if name not in POLICIES:
        raise PolicySpecError(f"unknown policy {name!r}; known policies: {', '.join(sorted(POLICIES))} (see `kveval policies`)")
    cls = POLICIES[name]
    types_ = param_types(cls)
    valid = list(types_)
    raw: dict[str, str] = {}
    if args and args.strip():
        for i, part in enumerate(args.split(",")):
            if "=" in part:
                key, value = (x.strip() for x in part.split("=", 1))
            elif i == 0 and valid:  # one positional argument: the first field, e.g. window(64)
                key, value = valid[0], part.strip()
            else:
                raise PolicySpecError(f"{name}: argument {part.strip()!r} needs a name; parameters: {', '.join(valid) or 'none'}")
            if key not in types_:
                raise PolicySpecError(f"{name} has no parameter {key!r}; parameters: {', '.join(valid) or 'none'}")
            if key in raw:
                raise PolicySpecError(f"{name}: parameter {key!r} is given twice ({key}={raw[key]} and {key}={value}); give it once")
            raw[key] = value
    return make_policy(cls, raw)


def make_policy(cls: type["Policy"], params: dict) -> "Policy":
    """Build a policy from parameter values (spec text or typed values), checking each against its declared type."""
    types_ = param_types(cls)
    kwargs = {}
    for key, value in params.items():
        if key not in types_:
            raise PolicySpecError(f"{cls.name} has no parameter {key!r}; parameters: {', '.join(types_) or 'none'}")
        try:
            kwargs[key] = types_[key].convert(value)
        except ValueError:
            raise PolicySpecError(f"{cls.name}: {key}={value} is not {types_[key].describe()}") from None
    try:
        policy = cls(**kwargs)
    except PolicySpecError:
        raise
    except (TypeError, ValueError) as exc:
        raise PolicySpecError(f"{cls.name}: {exc}") from exc
    policy.given = frozenset(kwargs)
    return policy


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
            sized = isinstance(p, RatioSelectionPolicy) or getattr(p, "ratio", None) is not None
            terms.append(p.name if sized else p.spec())
        return "+".join(terms) if terms else "none"

    @property
    def ratio(self) -> float | None:
        return self.selection.nominal_ratio if self.selection is not None else None

    @property
    def is_none(self) -> bool:
        return self.selection is None and self.structure is None and self.quantization is None

    def __str__(self) -> str:
        return self.spec

    def fit_groups(self, head_dim: int | None = None) -> None:
        """Make the quantization's per-token groups divide what it quantizes, or refuse.

        What it quantizes is the structure's coefficients (``lowrank(rank=16)``:
        16 per token) or, with no structure and a known ``head_dim``, the heads
        themselves. An unset group adapts to the largest divisor of that width
        not above its default (recorded in :attr:`spec`); an explicit group
        that does not divide it raises :class:`PolicySpecError`.
        """
        if self.quantization is None:
            return
        if self.structure is not None:
            widths, label = self.structure.stored_widths(head_dim or 0), "rank"
        elif head_dim is not None:
            widths, label = {"k": head_dim, "v": head_dim}, "head_dim"
        else:
            return
        if widths:
            self.quantization.fit_widths(widths, label)


def parse_policy(spec: "str | PolicyStack | None") -> PolicyStack:
    """Parse a spec string such as ``"snapkv(ratio=0.5)+kivi(bits=4)"``.

    Raises
    ------
    PolicySpecError
        (a ``ValueError``) One line naming the problem: unknown policy or parameter, value out of
        range, or two policies of the same family.
    """
    if isinstance(spec, PolicyStack):
        return spec
    if spec is None or not str(spec).strip():
        return PolicyStack()
    stack = PolicyStack()
    for term in _split_terms(str(spec)):
        if not term.strip():
            raise PolicySpecError(f"empty term in policy spec {spec!r}; join policies with a single '+'")
        policy = parse_term(term)
        if policy.family == "none":
            continue
        if getattr(stack, policy.family) is not None:
            raise PolicySpecError(f"policy spec {spec!r} has two {policy.family} policies; stack at most one each of {', '.join(FAMILY_ORDER)}")
        setattr(stack, policy.family, policy)
    if stack.selection is not None and stack.selection.per_head_budgets and stack.structure is not None:
        raise PolicySpecError(f"policy spec {spec!r}: {stack.selection.name} keeps a different number of tokens per head, "
                              f"which {stack.structure.name} cannot store; stack it with quantization only")
    stack.fit_groups()
    return stack
