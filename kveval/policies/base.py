"""The policy contract: the abstract families every policy implements, and :class:`PolicyStack`, their composition.

A *policy* is a small validated config object. Three families stack, applied in
this order to the tokens of a sequence:

1. selection (which tokens stay): ``window``, ``streaming``, ``h2o``, ``snapkv``, ...
2. structure (how each kept token is represented): ``lowrank``, ``latent``; across layers ``share``, ``minicache``
3. quantization (how the stored numbers are encoded): ``quant``, ``kivi``, ``fp8``

Spec strings are what users type, e.g. ``snapkv(ratio=0.5)+kivi(bits=4)``:
``name(key=value, ...)`` terms joined by ``+``, at most one per family. Every
parameter has a declared type (its dataclass annotation: ``bool``, ``int``,
``float`` or ``str``, optionally ``None``); a value of another type, an unknown
or repeated parameter is one :class:`~kveval.errors.PolicySpecError` line.
The canonical spec (:attr:`PolicyStack.spec`) parses back to the same stack.

This module is the policy contract in one file (about 700 lines): the families' abstract bases, the
capabilities they declare and the stack that composes them are read together by anyone adding a policy, and a
split would send that reader to three files for one interface.
"""

from __future__ import annotations

import enum
import math
from pathlib import Path
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from collections.abc import Hashable, Sequence
from typing import TYPE_CHECKING, Callable, ClassVar

from kveval.errors import PolicySpecError
from kveval.paths import DEFAULT_CALIBRATION
from kveval.tensors.ranking import ADAKV_FLOOR, adaptive_choice, adaptive_choice_batch, top_slots
from kveval.tensors.scoring_state import ScoringState

if TYPE_CHECKING:  # torch is imported where a policy runs on a model's tensors, never to parse or plan one
    import torch

    from kveval.tensors.quant_format import TensorQuant


FAMILY_ORDER = ("selection", "structure", "quantization")


class Placement(enum.Enum):
    """Where in a model's own cache a policy can act beyond per-head K/V (which every policy of its family takes):
    what a policy declares in :attr:`Policy.placements`, and what the checks made before the weights load ask
    (:mod:`kveval.policies.compatibility`). A policy that declares none of a model's is refused there."""

    #: DeepSeek V3.2's (GLM MoE-DSA's) MLA latent: one decision per token for every head at once, the token's indexer
    #: key leaving with it; a selection scoring without attention (the model's attention carries the indexer's top-k).
    LATENT = "V3.2's latent with its indexer keys"
    #: The same tokens in every layer, whatever the layer's scores: where a layer reuses an earlier layer's top-k
    #: slots (GLM MoE-DSA's shared indexers), the slots then name the same tokens.
    SAME_TOKENS_EVERY_LAYER = "the same tokens in every layer"
    #: DeepSeek V4's compressed CSA/HCA entries (a CSA entry's indexer key with it), sized by ``ratio``: a selection
    #: scoring an entry by itself (its key, its position, a seed) or by the model's own indexer.
    ENTRIES = "V4's compressed entries"
    #: The parts of a model's own cache layer coded as keys alone (V3.2's indexer keys, V4's window, entries and their
    #: indexer keys): a quantizer defining :meth:`QuantizationPolicy.part_codes`.
    PARTS = "the parts of a model's own cache layer"


class Need(enum.Enum):
    """What a policy needs from the model or the cache to run (:attr:`Policy.needs`)."""

    ATTENTION = "attention probabilities"
    QUERIES = "the prefill's queries"
    INDEXER = "DeepSeek V4's indexer scores"
    ROPE_HOOK = "keys before RoPE (a RoPE hook)"
    CALIBRATION = "a calibration pass over the model"
    #: Layers read other layers' K/V (``share``, ``minicache``): what the prefill computes differs from the
    #: uncompressed prefill's, so such a stack prefills alone (:attr:`PolicyStack.prefills_alone`), never derived
    #: from a prefill shared with other policies.
    CROSS_LAYER = "other layers' K/V (layers that read another layer's cache)"


@dataclass
class Policy(ABC):
    """Base of every policy. Subclasses are dataclasses whose fields are the spec parameters.

    A concrete policy belongs to one family, through one of :class:`SelectionPolicy`,
    :class:`StructurePolicy` or :class:`QuantizationPolicy`, and implements that family's abstract methods.
    """

    name: ClassVar[str] = ""
    family: ClassVar[str] = ""
    description: ClassVar[str] = ""
    given: ClassVar[frozenset[str] | None] = None  # set per object by the parser: the parameters the spec named
    #: Where in a model's own cache this policy can act (:class:`Placement`); none by default.
    placements: ClassVar[frozenset[Placement]] = frozenset()

    def supports(self, placement: Placement) -> bool:
        """Whether this policy can act on ``placement`` of a model's own cache."""
        return placement in self.placements

    @property
    def needs(self) -> frozenset[Need]:
        """What this policy needs from the model or the cache to run (:class:`Need`); nothing by default."""
        return frozenset()

    def check_given(self) -> None:
        """Refuse a parameter the spec named that does nothing beside the others (one
        :class:`~kveval.errors.PolicySpecError` line), once :attr:`given` is known. Default: nothing to refuse."""

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
    (the most recent query), ``"queries"`` (no attention mass: the prefill's queries themselves,
    ``ScoringState.queries``; such a policy prefills alone, as no shared prefill keeps queries).
    """

    family: ClassVar[str] = "selection"
    attention: ClassVar[str] = "none"
    supports_decode_budget: ClassVar[bool] = True
    ratio = None  # the fraction of context tokens removed, for a policy sized by one (a dataclass field there)
    decode_budget = None  # tokens the cache may hold while decoding; None lets it grow
    decode_interval = 1  # decode steps the cache may grow past decode_budget before it is compressed back to it
    #: :meth:`scores` also takes a whole batch: the state's tensors may carry leading row dimensions
    #: (``[rows, kv_heads, tokens]``), and each row's scores depend on that row alone, as they would for the row
    #: by itself. The cache then keeps a decode budget for the batch at once (:mod:`kveval.cache.buffered_decode`).
    batch_scores: ClassVar[bool] = False
    #: With ``batch_scores``, :meth:`scores` reads the state's positions and attention alone (never its keys, layer,
    #: seed or model): the decode budgets of a forward's layers may then be scored at once, on their rows stacked
    #: (:class:`kveval.cache.decode_evictions.DeferredEvictions`).
    scores_stack_layers: ClassVar[bool] = False
    #: :meth:`scores` reads the stored values (``state.values``: CUR, LagKV, CriticalKV); the others get ``None``.
    reads_values: ClassVar[bool] = False
    #: A threshold, not a count, decides what stays (:mod:`kveval.policies.threshold`): :meth:`choose` runs even where
    #: :meth:`keep_count` keeps every candidate, and the ratio reached is measured per item.
    thresholded: ClassVar[bool] = False
    #: :meth:`scores` reads the row's seed (``state.seed``: the ``random`` control). Rows share one compressed
    #: prefix only when their seeds agree (:func:`kveval.runner.prefixes.plan_prefixes`).
    reads_row_seed: ClassVar[bool] = False
    #: Scores come from forwards run after the prefill (KVzip's reconstruction: :mod:`kveval.cache.reconstruction`):
    #: the cache defers compression until the generation driver has run them, and :meth:`choose` runs even where
    #: :meth:`keep_count` keeps every candidate (the budget is over all layers at once).
    reconstructs: ClassVar[bool] = False

    @abstractmethod
    def keep_count(self, n_tokens: int, layer_idx: int = 0, num_layers: int = 1) -> int:
        """How many of ``n_tokens`` context tokens to keep in layer ``layer_idx``."""

    @abstractmethod
    def scores(self, state: "ScoringState") -> "torch.Tensor":
        """Per KV head and token, higher = more worth keeping; shape ``[kv_heads, tokens]``."""

    def planned_keep(self, n_tokens: int, layer_idx: int = 0, num_layers: int = 1,
                     achieved_ratio: float | None = None) -> int:
        """Tokens the memory planner sizes layer ``layer_idx`` at, of ``n_tokens`` context tokens: :meth:`keep_count`
        by default. ``achieved_ratio``: the fraction removed that a finished run reached on average (``None``
        outside a run's deployment decision), for a policy whose kept count the scores decide."""
        return self.keep_count(n_tokens, layer_idx, num_layers)

    @property
    def needs(self) -> frozenset[Need]:
        """From :attr:`attention`: what the scores read beside keys and values."""
        return _ATTENTION_NEEDS.get(self.attention, frozenset({Need.ATTENTION}))

    @property
    def kept_queries(self) -> int | None:
        """With ``attention == "queries"``: how many of the row's most recent queries it keeps, appending each
        forward's (a decode-phase policy's observation window, R-KV's); ``None``: the prefill's queries alone,
        replaced by each forward's (Expected Attention)."""
        return None

    @property
    def decode_limit(self) -> int | None:
        """The most tokens a row holds between decode steps under :attr:`decode_budget`: the budget, plus the
        ``decode_interval - 1`` tokens it may grow by before the next eviction (``None``: no decode budget). A row
        holding more after a step's attention is compressed back to ``decode_budget``."""
        return None if self.decode_budget is None else self.decode_budget + self.decode_interval - 1

    @property
    def whole_head_fraction(self) -> float:
        """Fraction of KV heads that keep every token whatever the budget (DuoAttention's retrieval heads); the
        planner sizes a layer as that mix. 0 for a policy whose heads all keep the same count."""
        return 0.0

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
        """The fraction removed that the spec asked for (``None``: sized otherwise, or by a threshold)."""
        return self.ratio


#: What a selection's :attr:`~SelectionPolicy.attention` needs (any other kind: attention probabilities).
_ATTENTION_NEEDS = {"none": frozenset(), "queries": frozenset({Need.QUERIES}), "indexer": frozenset({Need.INDEXER})}


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
    decode_interval : int
        Compress every ``decode_interval`` steps, as kvpress's ``DecodingPress``
        (``compression_interval``, ``target_size`` = ``decode_budget``, the
        policy's own scores as its wrapped press): the cache grows past
        ``decode_budget`` for ``decode_interval - 1`` steps, and a row that then
        holds ``decode_budget + decode_interval`` tokens after a step's
        attention keeps its ``decode_budget`` best-scored (its newest always).
        The trigger is the row's length, not a step counter: from the first
        eviction on, that is every ``decode_interval`` steps, as kvpress, but a
        row whose prefill left fewer tokens than the budget is first compressed
        when it reaches ``decode_budget + decode_interval`` (kvpress compresses
        after ``compression_interval`` steps whatever the length). 1 (the
        default) evicts at every step over the budget. Needs ``decode_budget``;
        not with ``adaptive``. Above 1, rows decode one by one (no batched
        decode eviction).
    adaptive : bool
        AdaKV (Feng et al. 2024, "Ada-KV: Optimizing KV Cache Eviction by
        Adaptive Budget Allocation for Efficient LLM Inference"): the layer's
        budget (tokens kept x KV heads) is redistributed across its heads by
        score, top over the flattened ``[heads, tokens]`` scores, so heads keep
        different numbers of tokens (stored apart: :mod:`kveval.stores.headwise`).
        Stacks with quantization, not with a structure policy.
    floor : float
        AdaKV's safeguard: each head keeps at least this fraction of its even
        share (``keep``) by its own top scores; 0.2 as in the paper.
    """

    ratio: float | None = None
    budget: int | None = None
    decode_budget: int | None = None
    decode_interval: int = 1
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
        if self.decode_interval < 1:
            raise PolicySpecError(f"{self.name}: decode_interval={self.decode_interval} must be a positive number of decode steps")
        if self.decode_interval > 1 and self.decode_budget is None:
            raise PolicySpecError(f"{self.name}: decode_interval={self.decode_interval} needs decode_budget= (the tokens "
                                  f"the cache is compressed back to every decode_interval steps)")
        if self.decode_interval > 1 and self.adaptive:
            raise PolicySpecError(f"{self.name}: decode_interval with adaptive=true is not supported (heads holding "
                                  f"different counts would reach the limit at different steps); drop one of them")

    def check_given(self) -> None:
        if self.is_given("floor") and not self.adaptive:
            raise PolicySpecError(f"{self.name}: floor={self.floor:g} acts only with adaptive=true (AdaKV's per-head "
                                  f"safeguard); add adaptive=true or drop floor")

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
class RepresentationPolicy(Policy):
    """Changes how kept tokens are stored (structure or quantization): the interface the cache and runner use.

    The cache builds one store per sequence and layer, innermost first:
    ``quantization.make_store(DenseStore(kv_dtype, compute_dtype), ...)`` then
    ``structure.make_store(that, ...)``. The runner calls :meth:`prepare` once
    per model before the first forward pass and records :meth:`run_info` in
    ``run.json``.
    """

    @abstractmethod
    def make_store(self, inner, model, layer_idx: int):
        """The store of one sequence in layer ``layer_idx``, wrapping or replacing ``inner`` (keeping its dtypes)."""

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



@dataclass(frozen=True)
class PlannedWidths:
    """What a structure policy stores per token in one layer, as the planner sizes it.

    ``heads`` streams each of K and V (fewer than the layer's KV heads when heads share one latent), each ``k``
    and ``v`` numbers wide; ``None`` where calibration decides the width (``energy=``).
    """

    heads: int
    k: int | None
    v: int | None


@dataclass
class StructurePolicy(RepresentationPolicy):
    """Stores each kept token in another shape (low rank, a latent shared by heads): the structure family."""

    family: ClassVar[str] = "structure"
    #: Stored tokens keep the model's head widths (a structure across layers: ``share``), so a stacked quantizer
    #: codes K/V heads as it would with no structure, and is checked against the head dims.
    keeps_head_widths: ClassVar[bool] = False
    #: The families this structure stacks with (:func:`kveval.policies.spec.parse_policy` refuses the others).
    stacks_with: ClassVar[frozenset[str]] = frozenset({"selection", "quantization"})

    @abstractmethod
    def planned_widths(self, kv_heads: int, k_width: int, v_width: int, mla: bool = False) -> PlannedWidths:
        """The streams this structure stores for a layer of ``kv_heads`` heads whose K rows are ``k_width`` and V
        rows ``v_width`` numbers wide, refusing (:class:`~kveval.errors.PolicySpecError`) a shape it cannot store.

        ``mla``: the layer is an MLA cache as kveval holds it, one "head" of the latent in K's place and the shared
        RoPE key (``v_width``, 0 when the model has none) in V's.
        """

    def reused_layers(self, layer_kinds: "Sequence[Hashable | None]") -> dict[int, int]:
        """Layers that store nothing and read another layer's K/V: reading layer -> source layer, on a model whose
        layer ``i`` is of kind ``layer_kinds[i]`` (equal kinds: same window, chunking and head layout; ``None``: no
        K/V). The cache gives such a layer no store, the planner sizes it at 0 bytes. Default: none."""
        return {}

    def merged_layers(self, layer_kinds: "Sequence[Hashable | None]") -> dict[int, int]:
        """Pairs of layers whose prefill tokens are merged into one store each (MiniCache): later layer -> earlier
        layer, on a model of ``layer_kinds`` as in :meth:`reused_layers`. The cache merges a pair's rows with
        :meth:`merge_stores` once the later layer has compressed its prefill; the planner sizes the pair with
        :meth:`merged_bytes`. Default: none."""
        return {}

    def merge_stores(self, first, second, coded=None):
        """The stores of one sequence in a pair's earlier and later layer (:meth:`merged_layers`), holding their
        prefill uncoded, as the two stores that replace them; ``coded(compute_dtype)`` makes an empty store coded as
        the stack's quantizer codes the later layer (``None``: no quantizer). Reached only for a structure that names
        pairs."""
        raise NotImplementedError(f"{self.spec()} merges no layers")

    def merged_bytes(self, tokens: int, new_tokens: int, heads: int, width: int, dtype_bytes: int,
                     coded: "Callable[[int], int] | None" = None) -> tuple[int, int]:
        """Bytes of one stream (K or V, ``heads`` heads of rows ``width`` wide) in a merged pair's earlier and later
        layer after ``tokens`` prefill tokens and ``new_tokens`` more; ``coded(n)``: the bytes of ``n`` tokens of
        the stream in one store of the stack's quantizer (``None``: in the cache dtype). Reached only for a
        structure that names pairs."""
        raise NotImplementedError(f"{self.spec()} merges no layers")

    def stack_refusal(self, other: "Policy") -> str | None:
        """Why this structure cannot stack with ``other`` (a selection or quantization of a family it
        :attr:`stacks_with`), in words, or ``None``: it can (the default)."""
        return None

    def model_widths(self, kv_heads: int, head_dim: int) -> dict[str, int] | None:
        """Numbers per token and KV head of K and V on a model of ``kv_heads`` heads of ``head_dim``, checked against
        it before the weights load; ``None`` when they are not per head (the policy checked the shape itself)."""
        return self.stored_widths(head_dim)


@dataclass(frozen=True)
class PlannedCoding:
    """How a quantizer stores K and V (and, on a model's own cache layer, each part of keys alone), as the memory
    planner sizes it.

    Either grouped codes with per-group scales (``key`` and ``value``, a
    :class:`~kveval.tensors.quant_format.TensorQuant` each), or codes sized per token (``token_bytes(key_dim,
    value_dim, itemsize)``: the bytes ``(K, V)`` one coded token holds per KV head, such as KVQuant's codes and
    outliers or an engine's blocks; ``label`` names them in a storage column). Either way the ``residual`` newest
    tokens and those at positions below ``sink`` stay in the cache dtype. Per-model tables (KVQuant's codebooks)
    are not per-sequence bytes and are not planned.
    """

    key: "TensorQuant | None" = None
    value: "TensorQuant | None" = None
    token_bytes: "Callable[[int, int, int], tuple[int, int]] | None" = None
    residual: int = 0
    sink: int = 0
    label: str = ""
    #: The layers kept in the cache dtype whatever the coding, from the model's ``num_hidden_layers`` and whether it
    #: is a hybrid (attention beside state layers); ``None``: none (vLLM's TurboQuant keeps its boundary layers).
    native_layers: "Callable[[int, bool], frozenset[int]] | None" = None

    @property
    def grouped(self) -> bool:
        """Whether the codes are grouped with per-group scales (``key``, ``value``) rather than sized per token."""
        return self.token_bytes is None


@dataclass
class QuantizationPolicy(RepresentationPolicy):
    """Encodes the stored numbers in fewer bits: the quantization family."""

    family: ClassVar[str] = "quantization"
    #: How the DSA indexer's keys are coded (DeepSeek V3.2, GLM MoE-DSA, V4's CSA layers): ``same`` as the other
    #: parts, ``native`` in the cache dtype, ``fp8`` as DeepSeek serves them. A parameter of the quantizers that
    #: code those models' parts (:attr:`Placement.PARTS`); ``same`` for the others.
    indexer = "same"
    #: Tokens are coded as they arrive and the prefill's attention reads the codes (a serving engine's cache): no
    #: uncompressed prefill can be shared with other policies and derived into this one.
    codes_on_arrival: ClassVar[bool] = False
    def mla_refusal(self, model_name: str) -> str | None:
        """Why this quantizer cannot code ``model_name``'s MLA cache (one line), or ``None``: it can (the default)."""
        return None

    #: The serving engine whose own KV cache format this reproduces, as ``kveval memory --engine`` names it
    #: (``vllm``, ``llamacpp``, ...); ``None``: a format no engine serves as it stands. The engine planner sizes only
    #: what the chosen engine can run.
    serving_engine: ClassVar[str | None] = None

    @property
    def residual_tokens(self) -> int:
        """The newest tokens kept in the cache dtype, unquantized (KIVI's residual window). 0 by default."""
        return 0

    def attended_query(self, query: "torch.Tensor") -> "torch.Tensor":
        """The queries (``[B, heads, q, head_dim]``, after RoPE) as the Q.K product takes them: an engine whose dot
        products convert Q to the K cache's type (llama.cpp) rounds them here. Default: unchanged."""
        return query

    @abstractmethod
    def check_head_dim(self, head_dim: int) -> None:
        """Refuse (:class:`~kveval.errors.PolicySpecError`) a head width this quantizer cannot code."""

    @abstractmethod
    def fit_widths(self, widths: dict[str, int], label: str) -> None:
        """Adapt unset groups to the widths of K and V it will code (each a ``label``: ``rank``, ``head_dim``), or
        refuse an explicit group that does not divide them."""

    def check_part_widths(self, keys: dict[str, int], values: dict[str, int]) -> None:
        """Refuse (:class:`~kveval.errors.PolicySpecError`), before the weights load, widths of a model's cache parts
        this quantizer cannot code: ``keys`` the parts coded with K's coding (part name -> values per entry: an MLA
        latent, V3.2's indexer keys, V4's window and entries), ``values`` those coded with V's (an MLA layer's RoPE
        key). Default: nothing to refuse (grouped quantizers fit their groups to each part's width)."""

    @abstractmethod
    def planned_coding(self) -> PlannedCoding:
        """K's and V's codes as the memory planner sizes them (:class:`PlannedCoding`), with the tokens kept in the
        cache dtype; on a model's own cache layer each part of keys alone is sized as K's coding."""

    def check_cache(self, shape) -> None:
        """Refuse, in one line (:class:`~kveval.errors.UnsupportedModelError`), a model's cache this quantizer cannot
        code, before the weights load; ``shape``: what one token of it holds
        (:class:`~kveval.policies.compatibility.CacheShape`). Default: any cache (a serving engine's DeepSeek records
        apply to DeepSeek's caches alone)."""

    def planned_part_coding(self, part: str, width: int) -> "PlannedCoding | None":
        """How the planner sizes part ``part`` (``width`` values an entry) of a model's own cache layer where this
        quantizer codes it its own way; ``None`` (the default): as K's coding
        (:func:`~kveval.policies.compatibility.part_coding`)."""
        return None

    def part_codes(self, model, layer_idx: int, part: str, width: int, kv_dtype: "torch.dtype", stride: int):
        """How one row of part ``part`` of a model's own cache layer is coded (:mod:`kveval.cache.native_layers`:
        DeepSeek V3.2's indexer keys, V4's compressed entries and their indexer keys): keys alone, ``width`` numbers
        per entry, one entry per ``stride`` tokens; a sequence with the interface of
        :class:`~kveval.stores.quantized.QuantizedSequence` (``append``, ``seal``, ``select``, ``materialize``,
        ``length``, ``nbytes``). Quantizers that define no coding of such parts are refused on those models before
        the weights load (:func:`kveval.policies.compatibility.check_policy`), so this default is never reached there."""
        raise PolicySpecError(f"{self.spec()}: codes no part {part!r} of a model's own cache layer")


def check_calib_tokens(name: str, tokens: int | None, text: str | None) -> None:
    """Refuse ``calib_tokens`` beyond what the calibration text (``text``, default the shipped one) can give: no
    tokenizer makes more tokens of a text than it has UTF-8 bytes plus a few special ones, and a pass over fewer
    tokens than asked would be recorded as the one asked for. A missing file is refused where the text is read."""
    if tokens is None:
        return
    if not isinstance(tokens, int) or isinstance(tokens, bool) or tokens < 2:
        raise PolicySpecError(f"{name}: calib_tokens={tokens!r} must be an integer of at least 2")
    path = DEFAULT_CALIBRATION if text is None else Path(text).expanduser()
    try:
        size = path.stat().st_size
    except OSError:
        return
    if tokens > size + 2:
        raise PolicySpecError(f"{name}: calib_tokens={tokens} is more than the calibration text {path.name} can give "
                              f"({size:,} bytes, so fewer tokens than that); give fewer, or a longer text with "
                              f"calibration=PATH")


def require_stack(policy: "PolicyStack | None", where: str) -> "PolicyStack":
    """``policy`` as a stack (``None``: the baseline). A spec string here is a caller's bug: specs are parsed once,
    at the edge (:func:`kveval.policies.spec.parse_policy`), and nothing below re-parses them."""
    if policy is None:
        return PolicyStack()
    if not isinstance(policy, PolicyStack):
        raise TypeError(f"{where} takes a PolicyStack, not {type(policy).__name__} {policy!r}; parse specs at the edge "
                        f"with kveval.policies.spec.parse_policy")
    return policy


@dataclass
class PolicyStack:
    """At most one policy of each family, applied selection -> structure -> quantization.

    ``PolicyStack()`` (all ``None``) is the uncompressed baseline, spec ``none``.
    """

    selection: SelectionPolicy | None = None
    structure: StructurePolicy | None = None
    quantization: QuantizationPolicy | None = None

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
            sized = isinstance(p, SelectionPolicy) and p.nominal_ratio is not None or isinstance(p, RatioSelectionPolicy)
            terms.append(p.name if sized else p.spec())
        return "+".join(terms) if terms else "none"

    @property
    def ratio(self) -> float | None:
        return self.selection.nominal_ratio if self.selection is not None else None

    @property
    def prefills_alone(self) -> bool:
        """Whether this stack needs a prefill of its own: its quantization codes tokens on arrival, or its selection
        reads the prefill's queries (which a shared prefill does not keep), or its selection scores with forwards
        of its own after the prefill (KVzip's reconstruction), or some layer reads another's K/V (:attr:`cross_layer`)."""
        return ((self.quantization is not None and self.quantization.codes_on_arrival)
                or (self.selection is not None and (self.selection.attention == "queries" or self.selection.reconstructs))
                or self.cross_layer)

    @property
    def cross_layer(self) -> bool:
        """Whether some layer reads another layer's K/V under this stack (:attr:`Need.CROSS_LAYER`)."""
        return any(p is not None and Need.CROSS_LAYER in p.needs for p in (self.selection, self.structure, self.quantization))

    @property
    def reads_row_seed(self) -> bool:
        """Whether what this stack keeps depends on each row's seed (:attr:`SelectionPolicy.reads_row_seed`)."""
        return self.selection is not None and self.selection.reads_row_seed

    @property
    def is_none(self) -> bool:
        return self.selection is None and self.structure is None and self.quantization is None

    def with_policy(self, policy: "Policy") -> "PolicyStack":
        """This stack with ``policy`` in its family's place, refused (:class:`PolicySpecError`) where one is there."""
        taken = {"selection": self.selection, "structure": self.structure, "quantization": self.quantization}
        if policy.family not in taken:
            raise PolicySpecError(f"{policy.name}: family {policy.family!r} is none of {', '.join(FAMILY_ORDER)}")
        if taken[policy.family] is not None:
            raise PolicySpecError(f"two {policy.family} policies ({taken[policy.family].spec()}, {policy.spec()}); "
                                  f"stack at most one each of {', '.join(FAMILY_ORDER)}")
        return PolicyStack(**{**taken, policy.family: policy})

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
        if self.structure is not None and not self.structure.keeps_head_widths:
            widths, label = self.structure.stored_widths(head_dim or 0), "rank"
        elif head_dim is not None:
            widths, label = {"k": head_dim, "v": head_dim}, "head_dim"
        else:
            return
        if widths:
            self.quantization.fit_widths(widths, label)
