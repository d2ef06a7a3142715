"""Outlier-aware K/V quantization after KVQuant: calibrated codebooks, pre-RoPE keys, sparse outliers, sinks.

Hooper et al. 2024, "KVQuant: Towards 10 Million Context Length LLM Inference
with KV Cache Quantization" (NeurIPS 2024). What this module implements, per
layer and KV head (``[H, T, D]`` tensors for one sequence):

* **Keys per channel, before RoPE.** Keys reach the cache after RoPE; the store
  un-rotates each key at its original position (the exact inverse of the
  model's own rotation, :class:`kveval.modeling.rope.RopeHook`), quantizes that,
  and rotates the reconstruction back when attention reads it. Per channel
  ``c`` a range ``[lo_c, hi_c]`` is calibrated offline (the ``outliers / 2`` and
  ``1 - outliers / 2`` quantiles of the calibration keys), as the paper does
  for keys so that each new key can be encoded alone; a key is normalized to
  ``z = (x - mid_c) / half_c`` (``mid_c = (lo_c + hi_c) / 2``, ``half_c = (hi_c - lo_c) / 2``).
* **Values per token**, normalized online by the token's own range (min/max over
  its non-outlier entries, held as float16 ``lo``/``hi``).
* **Non-uniform codebook** (``nuq``): ``2**bits`` levels in the normalized space
  ``[-1, 1]``, one per layer for K and one for V, learned by 1-D k-means on the
  normalized calibration values (the non-outlier ones); the paper weights
  k-means by Fisher sensitivity, which needs gradients, so this version is
  unweighted. ``nuq=false``: uniform levels ``linspace(-1, 1, 2**bits)``
  (plain asymmetric integer quantization). A value is coded by its nearest level.
* **Dense-and-sparse outliers**: per token, the ``ceil(outliers * D)`` entries of
  largest magnitude (``|z|`` for keys, ``|x|`` for values) are kept exactly, in
  ``kv_dtype`` (pre-RoPE for keys), with their channel index (``uint8`` when
  ``D <= 256``, else ``int16``). The paper detects key outliers with per-channel
  thresholds (a variable count per token, CSR storage); a fixed per-token count
  gives the same budget in rectangular tensors that eviction can gather.
* **Attention sink**: tokens at original positions below ``sink`` stay in
  ``kv_dtype``, as they arrived (post-RoPE); so do the ``residual`` most recent tokens.

Bytes (:attr:`KVQuantStore.nbytes`) count everything held per token: packed
codes (``ceil(D * bits / 8)`` bytes per vector), outlier values and indices,
the values' ``lo``/``hi``, and the full-precision sink and residual tokens.
Per-model tensors (codebooks, key channel ranges) are counted once per model by
:meth:`KVQuantCodec.nbytes` (see :meth:`kveval.policies.kvquant.KVQuantPolicy.codebook_bytes`).
Original positions are the cache's bookkeeping (every policy holds them), not counted here.

Positions: the cache tells the store every held token's position before it
seals (:meth:`KVQuantStore.place_positions`); a store used alone numbers tokens
in the order they were appended.

One module, past 600 lines, on purpose: the codec's encoded tensors (codes, outliers, ranges, by name) are the
store's per-token layout and the calibration's output is only ever that codec, so the three halves change together
(a new field of the encoding touches the calibration, the codec and the bytes the store counts).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kveval.calibration.kv import calibration_kv_parts, load_versioned, save_atomic
from kveval.errors import PolicySpecError, UsageError
from kveval.modeling.rope import rope_hook
from kveval.stores.base import BatchFamily, TokenStore, alive_order, alive_slots
from kveval.stores.quantized import KeysOnlySequence
from kveval.tensors.quantization import SCALE_DTYPE, pack_bits, unpack_bits

KVQUANT_VERSION = 1  # bump when the calibration procedure changes: old cache files are then ignored
_KMEANS_SAMPLES = 1 << 20  # normalized values a codebook is fitted on (evenly strided subsample)
_KMEANS_STEPS = 40


def outlier_count(head_dim: int, outliers: float) -> int:
    """Entries per vector kept as sparse outliers: ``ceil(outliers * head_dim)`` (0 for ``outliers == 0``)."""
    return min(head_dim, math.ceil(outliers * head_dim - 1e-9))


def index_dtype(head_dim: int) -> torch.dtype:
    """Smallest integer dtype that holds a channel index below ``head_dim``."""
    return torch.uint8 if head_dim <= 256 else torch.int16


def kmeans_1d(x: torch.Tensor, levels: int) -> torch.Tensor:
    """``levels`` sorted centroids of the 1-D samples ``x`` (Lloyd's algorithm from evenly spaced quantiles)."""
    x = x.flatten().float()
    if x.numel() > _KMEANS_SAMPLES:
        x = x[:: math.ceil(x.numel() / _KMEANS_SAMPLES)]
    if x.numel() == 0:
        return torch.linspace(-1, 1, levels)
    centroids = torch.quantile(x, (torch.arange(levels, dtype=torch.float32) + 0.5) / levels)
    for _ in range(_KMEANS_STEPS):
        assign = torch.bucketize(x, (centroids[1:] + centroids[:-1]) / 2)
        sums = torch.zeros(levels).scatter_add_(0, assign, x)
        counts = torch.zeros(levels).scatter_add_(0, assign, torch.ones_like(x))
        updated = torch.where(counts > 0, sums / counts.clamp(min=1), centroids)
        updated, _ = updated.sort()
        if torch.equal(updated, centroids):
            break
        centroids = updated
    return centroids


def _top_mask(score: torch.Tensor, k: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Indices ``[..., k]`` (ascending) of the ``k`` largest ``score`` entries of each vector and their mask."""
    if k == 0:
        return None, None
    index = score.topk(k, dim=-1).indices.sort(dim=-1).values
    return index, torch.zeros_like(score, dtype=torch.bool).scatter_(-1, index, True)


def token_range(v: torch.Tensor, outlier: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per vector, min and max over its non-outlier entries (0 and 0 when all are outliers), as float16 ``[..., 1]``."""
    lo = (v if outlier is None else v.masked_fill(outlier, float("inf"))).amin(dim=-1, keepdim=True)
    hi = (v if outlier is None else v.masked_fill(outlier, float("-inf"))).amax(dim=-1, keepdim=True)
    lo, hi = lo.nan_to_num(posinf=0.0, neginf=0.0), hi.nan_to_num(posinf=0.0, neginf=0.0)
    return lo.to(SCALE_DTYPE), hi.to(SCALE_DTYPE)


def centre_half(lo: torch.Tensor, hi: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Centre and half-range (at least 1e-8) of the float16 ``lo``/``hi``, in float32."""
    lo, hi = lo.float(), hi.float()
    return (lo + hi) / 2, ((hi - lo) / 2).clamp(min=1e-8)


# --- the per-layer codec -----------------------------------------------------------------------
@dataclass
class KVQuantCodec:
    """One layer's calibrated encoding (shared by every sequence's store of that layer).

    ``key_mid``/``key_half``: ``[H, D]`` float32 per-channel centre and half-range
    (of pre-RoPE keys when ``rope`` is set); ``key_levels``/``value_levels``:
    ``[2**bits]`` sorted float32 codebooks in ``[-1, 1]``; ``outliers``: entries
    per vector kept sparse; ``rope``: the layer's :class:`~kveval.modeling.rope.RopeHook`,
    ``None`` to quantize keys as they arrive (post-RoPE).

    A part that holds keys alone (DeepSeek V4's K=V entries, the indexer's keys: values of width 0) has an empty
    ``value_levels``: its values are neither coded nor stored.
    """

    bits: int
    key_mid: torch.Tensor
    key_half: torch.Tensor
    key_levels: torch.Tensor
    value_levels: torch.Tensor
    outliers: int
    rope: object = None
    #: The values' width and their outliers per vector (``None``: the keys'); an MLA latent's RoPE key is narrower.
    value_dim: int | None = None
    value_outliers: int | None = None
    _on: dict = field(default_factory=dict, repr=False)

    @property
    def head_dim(self) -> int:
        return self.key_mid.shape[-1]

    @property
    def widths(self) -> dict[str, int]:
        """Numbers per vector of K (``"k"``) and V (``"v"``)."""
        return {"k": self.head_dim, "v": self.head_dim if self.value_dim is None else self.value_dim}

    def nbytes(self) -> int:
        """Per-model bytes of this layer: both codebooks and the key channel ranges, as float32."""
        return 4 * (self.key_levels.numel() + self.value_levels.numel() + self.key_mid.numel() + self.key_half.numel())

    def _tensors(self, device) -> dict[str, torch.Tensor]:
        key = str(device)
        if key not in self._on:
            levels = {"k": self.key_levels.to(device), "v": self.value_levels.to(device)}
            self._on[key] = {"mid": self.key_mid.to(device), "half": self.key_half.to(device), **levels,
                             "k_edges": (levels["k"][1:] + levels["k"][:-1]) / 2,
                             "v_edges": (levels["v"][1:] + levels["v"][:-1]) / 2}
        return self._on[key]

    @staticmethod
    def _level_codes(z: torch.Tensor, kind: str, t: dict) -> torch.Tensor:
        """The nearest level's index of each normalized entry (``uint8``, not packed)."""
        return torch.bucketize(z.clamp(-1, 1), t[f"{kind}_edges"]).to(torch.uint8)

    def _sparse(self, x: torch.Tensor, score: torch.Tensor, kv_dtype: torch.dtype, data: dict, kind: str) -> torch.Tensor | None:
        count = self.value_outliers if kind == "v" and self.value_outliers is not None else self.outliers
        index, mask = _top_mask(score, count)
        if index is not None:
            data[f"{kind}_out"] = x.gather(-1, index).to(kv_dtype)
            data[f"{kind}_idx"] = index.to(index_dtype(x.shape[-1]))
        return mask

    def encode(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, kv_dtype: torch.dtype) -> dict:
        """Per-token tensors of ``[H, T, D]`` keys (post-RoPE) and values at ``positions`` (``[H, T]``)."""
        return self._encode(keys, values, positions, kv_dtype, None)[0]

    def read_encoded(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor, kv_dtype: torch.dtype,
                     dtype: torch.dtype, bound: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``decode(encode(keys, values, positions, kv_dtype), positions, dtype)``, bit for bit, from the encoding's
        own codes, ranges and RoPE angles, with no packing and unpacking and no second lookup of the angles: what a
        batched decode step needs (each row's newest token as its store will read it) in about a third fewer
        small operations. ``bound``: a number above every position, known on the host (:meth:`RopeHook.cos_sin`)."""
        return self._encode(keys, values, positions, kv_dtype, dtype, bound)[1:]

    def _encode(self, keys, values, positions, kv_dtype, read_dtype, bound: int | None = None):
        """``(encode's tensors, None, None)``, or with ``read_dtype`` (:meth:`read_encoded`) ``(None, keys, values)``."""
        t, data = self._tensors(keys.device), {}
        angles = self.rope.cos_sin(positions, bound) if self.rope is not None else None
        x = self.rope.unrotate(keys, positions, angles) if self.rope is not None else keys.float()
        z = (x - t["mid"][:, None]) / t["half"][:, None]
        self._sparse(x, z.abs(), kv_dtype, data, "k")
        key_codes = self._level_codes(z, "k", t)
        v = values.float()
        if v.shape[-1]:
            data["v_lo"], data["v_hi"] = token_range(v, self._sparse(v, v.abs(), kv_dtype, data, "v"))
            mid, half = self._value_range(data)
            value_codes = self._level_codes((v - mid) / half, "v", t)
        if read_dtype is None:
            data["k_codes"] = pack_bits(key_codes, self.bits)
            if v.shape[-1]:
                data["v_codes"] = pack_bits(value_codes, self.bits)
            return data, None, None
        # As decode reads them: levels scaled back, outliers as stored, keys rotated at their positions.
        read_keys = self._with_outliers(t["k"][key_codes.long()] * t["half"][:, None] + t["mid"][:, None], data, "k")
        if self.rope is not None:
            read_keys = self.rope.rotate(read_keys, positions, angles)
        read_values = self._with_outliers(t["v"][value_codes.long()] * half + mid, data, "v") if v.shape[-1] else v
        return None, read_keys.to(read_dtype), read_values.to(read_dtype)

    @staticmethod
    def _value_range(data: dict) -> tuple[torch.Tensor, torch.Tensor]:
        return centre_half(data["v_lo"], data["v_hi"])

    def _dense(self, data: dict, kind: str, t: dict) -> torch.Tensor:
        codes = unpack_bits(data[f"{kind}_codes"], self.bits, self.widths[kind]).long()
        return t[kind][codes]

    def _with_outliers(self, x: torch.Tensor, data: dict, kind: str) -> torch.Tensor:
        if f"{kind}_idx" not in data:
            return x
        return x.scatter(-1, data[f"{kind}_idx"].long(), data[f"{kind}_out"].float())

    def decode(self, data: dict, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (post-RoPE again) and values ``[H, T, D]`` in ``dtype``."""
        t = self._tensors(positions.device)
        keys = self._dense(data, "k", t) * t["half"][:, None] + t["mid"][:, None]
        keys = self._with_outliers(keys, data, "k")
        if self.rope is not None:
            keys = self.rope.rotate(keys, positions)
        if "v_codes" not in data:  # a part of keys alone
            return keys.to(dtype), keys.new_zeros(*keys.shape[:-1], 0, dtype=dtype)
        mid, half = self._value_range(data)
        values = self._with_outliers(self._dense(data, "v", t) * half + mid, data, "v")
        return keys.to(dtype), values.to(dtype)


# --- calibration -------------------------------------------------------------------------------
@dataclass(frozen=True)
class KVQuantSettings:
    """What a calibration depends on besides the model and the text; also the ``kind`` protocol of
    :func:`kveval.calibration.kv.load_or_calibrate` (``KIND``, ``load``, ``calibrate``)."""

    bits: int
    outliers: float
    pre_rope: bool
    nuq: bool

    @property
    def KIND(self) -> str:  # noqa: N802  (the protocol's name)
        return f"kvquant{KVQUANT_VERSION}-b{self.bits}-o{self.outliers:g}-{'pre' if self.pre_rope else 'post'}-{'nuq' if self.nuq else 'uni'}"

    def load(self, path: Path) -> "KVQuantCalibration | None":
        return KVQuantCalibration.load(path, self)

    def calibrate(self, model, text, tokens: int, model_key: str = "") -> "KVQuantCalibration":
        return calibrate_kvquant(model, text, tokens, self, model_key)


@dataclass
class KVQuantCalibration:
    """Per layer: key channel centre/half-range ``[H, D]``, the K and V codebooks ``[2**bits]`` (float32) and the
    values' width; ``None`` for a layer without K/V (a hybrid model's Mamba or linear-attention layers).

    ``parts``: per layer, the same for each other part of a model's own cache layer (DeepSeek V3.2's indexer keys,
    V4's CSA/HCA entries and their indexer keys; :func:`kveval.calibration.kv.calibration_kv_parts`), by part name:
    parts of keys alone, one "head" each, calibrated on the entries the pass emitted; ``{}`` for other layers."""

    settings: KVQuantSettings
    layers: list[dict[str, torch.Tensor] | None]
    tokens: int
    text_sha256: str
    model_key: str
    path: Path | None = None
    parts: list[dict[str, dict]] = field(default_factory=list)

    def save(self, path: Path) -> None:
        save_atomic({"version": KVQUANT_VERSION, "kind": self.settings.KIND, "layers": self.layers, "tokens": self.tokens,
                     "text_sha256": self.text_sha256, "model_key": self.model_key, "parts": self.parts}, path)

    @classmethod
    def load(cls, path: Path, settings: KVQuantSettings) -> "KVQuantCalibration | None":
        """The calibration at ``path``; ``None`` when it is of another kind, or from before the values' width was
        recorded (an MLA latent's narrower RoPE key was then read at the latent's width: calibrated again)."""
        payload = load_versioned(path, KVQUANT_VERSION)
        if payload is None or payload.get("kind") != settings.KIND:
            return None
        if any(entry is not None and "value_dim" not in entry for entry in payload["layers"]):
            return None
        return cls(settings, payload["layers"], payload["tokens"], payload["text_sha256"], payload["model_key"], path,
                   payload.get("parts") or [{} for _ in payload["layers"]])

    def codec(self, layer: int, rope=None) -> KVQuantCodec:
        """The layer's :class:`KVQuantCodec` (``rope``: the layer's hook, required when calibrated pre-RoPE)."""
        return self._codec(self.layers[layer], rope)

    def part_codec(self, layer: int, part: str) -> KVQuantCodec:
        """The :class:`KVQuantCodec` of part ``part`` of native layer ``layer`` (keys alone, as they arrive); the
        calibration refuses a pass that left a part without entries (:func:`calibrate_kvquant`)."""
        return self._codec(self.parts[layer][part], None)

    def _codec(self, entry: dict, rope) -> KVQuantCodec:
        s, value_dim = self.settings, int(entry["value_dim"])
        return KVQuantCodec(s.bits, entry["key_mid"], entry["key_half"], entry["key_levels"], entry["value_levels"],
                            outlier_count(entry["key_mid"].shape[-1], s.outliers), rope, value_dim,
                            outlier_count(value_dim, s.outliers))

    def nbytes(self) -> int:
        """Per-model bytes of every layer's (and part's) codebooks and key channel ranges."""
        entries = [entry for entry in self.layers if entry is not None]
        entries += [entry for parts in self.parts for entry in parts.values()]
        return sum(self._codec(entry, None).nbytes() for entry in entries)


def _calibrate_layer(keys: torch.Tensor, values: torch.Tensor, s: KVQuantSettings) -> dict:
    """One layer's ranges and codebooks from its calibration keys (pre-RoPE when ``s.pre_rope``) and values
    (``[H, T, 0]`` for a part of keys alone: no value codebook)."""
    k = outlier_count(keys.shape[-1], s.outliers)
    tail = min(s.outliers / 2, 0.5)
    lo = torch.quantile(keys.transpose(1, 2), tail, dim=-1)  # [H, D]
    hi = torch.quantile(keys.transpose(1, 2), 1 - tail, dim=-1)
    mid, half = (lo + hi) / 2, ((hi - lo) / 2).clamp(min=1e-6)
    levels = 2**s.bits
    uniform = torch.linspace(-1, 1, levels)
    value_dim = values.shape[-1]
    entry = {"key_mid": mid, "key_half": half, "value_dim": value_dim}
    if not s.nuq:
        return {**entry, "key_levels": uniform, "value_levels": uniform.clone() if value_dim else uniform[:0]}
    z = (keys - mid[:, None]) / half[:, None]
    _, key_mask = _top_mask(z.abs(), k)
    keep_k = z.clamp(-1, 1) if key_mask is None else z[~key_mask].clamp(-1, 1)
    if not value_dim:
        return {**entry, "key_levels": kmeans_1d(keep_k, levels), "value_levels": uniform[:0]}
    _, value_mask = _top_mask(values.abs(), outlier_count(value_dim, s.outliers))
    vmid, vhalf = centre_half(*token_range(values, value_mask))
    zv = (values - vmid) / vhalf
    keep_v = zv.clamp(-1, 1) if value_mask is None else zv[~value_mask].clamp(-1, 1)
    return {**entry, "key_levels": kmeans_1d(keep_k, levels), "value_levels": kmeans_1d(keep_v, levels)}


def calibrate_kvquant(model, text, tokens: int, settings: KVQuantSettings, model_key: str = "") -> KVQuantCalibration:
    """One forward pass over the calibration text; per layer, key channel ranges and K/V codebooks, and those of
    each other part of a model's own cache layers (keys alone, post-RoPE: kveval has no RoPE hook for them)."""
    kv, others, used = calibration_kv_parts(model, text, tokens)
    layers = []
    for i, pair in enumerate(kv):
        if pair is None:
            layers.append(None)
            continue
        keys, values = pair
        if settings.pre_rope:  # at the angles of the calibration's one forward (a longrope's long ones past its length)
            hook = rope_hook(model, i)
            cos, sin = hook.one_forward_cos_sin(keys.shape[1], model.device)
            positions = torch.arange(keys.shape[1], device=model.device).expand(keys.shape[0], -1)
            keys = hook.unrotate(keys.to(model.device), positions, (cos[positions], sin[positions])).cpu()
        layers.append(_calibrate_layer(keys, values, settings))
    for i, layer in enumerate(others):
        for name, x in layer.items():
            if not x.shape[1]:
                raise UsageError(f"kvquant: the calibration pass ({used} tokens) emitted no {name!r} entries in layer "
                                 f"{i}, so its codebook cannot be fitted; give a longer calibration text or "
                                 f"calib_tokens")
    parts = [{name: _calibrate_layer(x, x[..., :0], settings) for name, x in layer.items()} for layer in others]
    return KVQuantCalibration(settings, layers, used, text.sha256, model_key, parts=parts)


# --- the store ---------------------------------------------------------------------------------
_BOOKKEEPING = ("positions",)  # held per token for re-rotation and sink placement; the cache holds them anyway


@dataclass
class _Segment:
    """Per-token tensors ``[H, n, ...]`` of one part of a store, and which slots are alive (``None``: all)."""

    data: dict[str, torch.Tensor] = field(default_factory=dict)
    alive: torch.Tensor | None = None

    @property
    def slots(self) -> int:
        return self.data["positions"].shape[1] if self.data else 0

    def live(self) -> torch.Tensor:
        return self.alive if self.alive is not None else self._everyone(self.data)

    def extend(self, data: dict[str, torch.Tensor], alive: torch.Tensor | None,
               counts: "tuple[int, int] | None" = None) -> None:
        """Add slots after those held; ``alive`` (``[H, n]``) marks which of them hold a token, ``None`` every one.
        ``counts``: the fewest and the most of them a head holds, where the caller read them (with other
        segments' and rows', in one read); else read here. Nothing is read where ``alive`` is ``None`` or
        ``counts`` are given (and the held slots all hold tokens)."""
        if not data["positions"].shape[1]:
            return
        if alive is not None:
            fewest, most = counts if counts is not None else torch.stack(alive.sum(dim=1).aminmax()).tolist()
            if not most:
                return
            if fewest == alive.shape[1]:
                alive = None
        held, held_all_alive = self.slots, self.alive is None
        if not held_all_alive or alive is not None:
            new = alive if alive is not None else self._everyone(data)
            self.alive = torch.cat([self.live(), new], dim=1) if self.data else new
        self.data = data if not self.data else {k: torch.cat([self.data[k], data[k]], dim=1) for k in self.data}
        if alive is not None:
            # Held slots all alive: head h keeps held + its own count, the longest held + most, and every slot
            # is alive once compact where every head keeps as many. Else the held dead slots are read.
            self.compact((held + most, fewest == most) if held_all_alive else None)

    @staticmethod
    def _everyone(data: dict[str, torch.Tensor]) -> torch.Tensor:
        p = data["positions"]
        return torch.ones(p.shape, dtype=torch.bool, device=p.device)

    def split(self, first: int) -> "_Segment":
        """Remove and return the first ``first`` slots."""
        head = _Segment({k: t[:, :first] for k, t in self.data.items()}, None if self.alive is None else self.alive[:, :first])
        self.data = {k: t[:, first:] for k, t in self.data.items()}
        self.alive = None if self.alive is None else self.alive[:, first:]
        if not self.slots:
            self.data, self.alive = {}, None
        return head

    def compact(self, known: "tuple[int, bool] | None" = None) -> None:
        """Drop slots dead in every head; heads keep their live slots in order (padded to the longest head).
        ``known``: how many slots the longest head keeps, and whether every head keeps as many, where the
        caller knows (else read)."""
        if self.alive is None:
            return
        keep = int(self.alive.sum(dim=1).max()) if known is None else known[0]
        if keep == 0:
            self.data, self.alive = {}, None
            return
        if keep < self.slots:
            order = alive_order(self.alive, keep)
            self.data = {k: t.gather(1, order.reshape(*order.shape, *([1] * (t.dim() - 2))).expand(-1, -1, *t.shape[2:]))
                         for k, t in self.data.items()}
            self.alive = self.alive.gather(1, order)
        if (bool(self.alive.all()) if known is None else known[1]):
            self.alive = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for k, t in self.data.items() if k not in _BOOKKEEPING)


class KVQuantStore(TokenStore):
    """One sequence's K/V in one layer as KVQuant holds them: sinks, encoded body, full-precision tail.

    Segments, in token order: ``sinks`` (positions below ``sink``, ``kv_dtype``),
    ``body`` (encoded by the layer's :class:`KVQuantCodec`), ``tail`` (appended,
    not sealed yet, or among the ``residual`` most recent; ``kv_dtype``).
    :meth:`seal` encodes each token once, from the ``kv_dtype`` copy it arrived
    as. :meth:`select` marks slots dead and drops the ones dead in every head; a
    head with fewer live slots than another keeps dead ones as padding (counted
    in :attr:`nbytes`, since the layout really holds them), as
    :class:`kveval.stores.quantized.QuantizedSequence` does. Nothing is re-encoded.
    """

    batch_family = BatchFamily.KVQUANT

    def __init__(self, codec: KVQuantCodec, sink: int, residual: int, kv_dtype: torch.dtype | None = None,
                 compute_dtype: torch.dtype | None = None, stride: int = 1):
        self.codec, self.sink, self.residual = codec, sink, residual
        self.kv_dtype, self.compute_dtype = kv_dtype, compute_dtype
        #: Tokens per appended vector: a store numbering its own vectors gives the ``n``-th position ``n * stride``
        #: (DeepSeek V4's compressed entries: the first token of the entry's window, so ``sink`` keeps the entries
        #: whose window holds a sink token).
        self.stride = stride
        self.sinks, self.body, self.tail = _Segment(), _Segment(), _Segment()
        self.count = 0  # live tokens per head
        self.appended = 0  # tokens ever appended (positions when the cache gives none)

    @property
    def segments(self) -> tuple[_Segment, _Segment, _Segment]:
        return self.sinks, self.body, self.tail

    @property
    def length(self) -> int:
        return self.count

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        if self.compute_dtype is None:
            self.compute_dtype = keys.dtype
        if keys.shape[0] != self.codec.key_mid.shape[0]:
            raise PolicySpecError(f"kvquant: calibrated per KV head for {self.codec.key_mid.shape[0]} heads, got a store of "
                                  f"{keys.shape[0]} (per-head budgets split heads apart); drop adaptive=/duo, or use kivi(...)")
        if keys.shape[-1] != self.codec.head_dim:
            raise PolicySpecError(f"kvquant: calibrated for head_dim={self.codec.head_dim}, got vectors of "
                                  f"{keys.shape[-1]} (kvquant quantizes K/V heads, not low-rank coefficients)")
        kv_dtype = self.kv_dtype or keys.dtype
        heads, new = keys.shape[0], keys.shape[1]
        positions = ((self.appended + torch.arange(new, device=keys.device)) * self.stride).expand(heads, -1)
        self.tail.extend({"keys": keys.to(kv_dtype), "values": values.to(kv_dtype), "positions": positions}, None)
        self.count += new
        self.appended += new

    def place_positions(self, positions: torch.Tensor) -> None:
        """Record the original position of every held token (``[H, length]``, in held order), as the cache knows them."""
        if not self.count:
            return
        if all(s.alive is None for s in self.segments):  # every slot holds a token: the positions in held order
            every = positions.to(self.tail.data["positions"].device if self.tail.data else positions.device).clone()
        else:
            live = torch.cat([s.live() for s in self.segments if s.data], dim=1)
            every = torch.cat([s.data["positions"] for s in self.segments if s.data], dim=1).clone()
            every[live] = positions.to(every.device).reshape(-1)
        start = 0
        for s in self.segments:
            if s.data:
                s.data["positions"] = every[:, start:start + s.slots]
                start += s.slots

    def seal(self) -> None:
        self.seal_all([self])

    def residual_intact(self) -> bool:
        return self.tail.alive is None

    def same_code(self, other: TokenStore) -> bool:
        """The same codec object (one layer's calibration), sink and residual window."""
        return (type(other) is KVQuantStore and other.codec is self.codec
                and (other.sink, other.residual) == (self.sink, self.residual))

    def _take_due(self) -> "tuple[_Segment, torch.Tensor, torch.Tensor] | None":
        """Take the tokens leaving the residual window out of the tail: the moved slots, those of them the sinks
        take (positions below ``sink``) and those the body takes (``[H, n]`` each), or ``None`` when none leave."""
        aged = self.tail.slots - self.residual
        if aged <= 0:
            return None
        old = self.tail.split(aged)
        live = old.live()
        is_sink = old.data["positions"] < self.sink
        return old, live & is_sink, live & ~is_sink

    @classmethod
    def seal_all(cls, stores: "list[KVQuantStore]") -> None:
        """Seal ``stores`` (one layer's rows) with one encoding per codec and dtype: the codec encodes each token
        alone (keys per channel on calibrated ranges, values per token, outliers and codes per vector, RoPE per
        position), so encoding the stores' due tokens side by side gives each store, bit for bit, what encoding
        its own due tokens alone gives, for a fraction of the small operations. How many slots each head of each
        row gives the sinks and the body is read once for the layer."""
        dues = [(store, due) for store in stores if (due := store._take_due()) is not None]
        if not dues:
            return
        counts = torch.stack([torch.stack((*sinks.sum(dim=1).aminmax(), *body.sum(dim=1).aminmax()))
                              for _, (_, sinks, body) in dues]).tolist()
        groups: dict[tuple, list] = {}
        for (store, (old, sinks, body)), (sink_fewest, sink_most, body_fewest, body_most) in zip(dues, counts):
            store.sinks.extend(old.data, sinks, (sink_fewest, sink_most))
            if body_most:
                keys = old.data["keys"]
                groups.setdefault((id(store.codec), keys.dtype, keys.shape[0]), []).append(
                    (store, old, body, (body_fewest, body_most)))
        for group in groups.values():
            olds = [old for _, old, _, _ in group]
            keys, values, positions = (torch.cat([old.data[name] for old in olds], dim=1) if len(olds) > 1
                                       else olds[0].data[name] for name in ("keys", "values", "positions"))
            encoded = group[0][0].codec.encode(keys, values, positions, keys.dtype)
            sizes = [old.slots for old in olds]
            parts = {name: tensor.split(sizes, dim=1) for name, tensor in encoded.items()}
            for i, (store, old, body, body_counts) in enumerate(group):
                store.body.extend({**{name: part[i] for name, part in parts.items()}, "positions": old.data["positions"]},
                                  body, body_counts)

    def keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        parts = []
        for s in self.segments:
            if not s.data:
                continue
            if s is self.body:
                parts.append(self.codec.decode(s.data, s.data["positions"], self.compute_dtype))
            else:
                parts.append((s.data["keys"].to(self.compute_dtype), s.data["values"].to(self.compute_dtype)))
        if not parts:
            return None, None
        keys = torch.cat([k for k, _ in parts], dim=1) if len(parts) > 1 else parts[0][0]
        values = torch.cat([v for _, v in parts], dim=1) if len(parts) > 1 else parts[0][1]
        if all(s.alive is None for s in self.segments):
            return keys, values
        live = torch.cat([s.live() for s in self.segments if s.data], dim=1)
        return (keys[live].reshape(keys.shape[0], -1, keys.shape[2]), values[live].reshape(values.shape[0], -1, values.shape[2]))

    def select(self, index: torch.Tensor) -> None:
        held = [s for s in self.segments if s.data]
        live = torch.cat([s.live() for s in held], dim=1)
        slots = alive_slots(live).gather(1, index)
        kept = torch.zeros_like(live).scatter_(1, slots, True)
        start = 0
        for s in held:
            s.alive = kept[:, start:start + s.slots]
            start += s.alive.shape[1]
            s.compact()
        self.count = index.shape[1]

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.segments)


class KVQuantPart(KeysOnlySequence):
    """One row's entries of a part of keys alone (``[1, n, width]``: DeepSeek V3.2's indexer keys, V4's compressed
    entries and their indexer keys) held as KVQuant holds keys: a :class:`KVQuantStore` of one "head", per-channel
    ranges and codebook calibrated on the part, sparse outliers, the sink's entries and the ``residual`` newest in
    the cache dtype. The sequence interface of :class:`~kveval.stores.quantized.QuantizedSequence` (what
    :class:`~kveval.cache.native_layers.PartSequence` holds)."""

    def __init__(self, codec: KVQuantCodec, sink: int, residual: int, kv_dtype: torch.dtype, stride: int = 1):
        super().__init__(KVQuantStore(codec, sink, residual, kv_dtype, stride=stride))


__all__ = ["KVQuantCalibration", "KVQuantCodec", "KVQuantPart", "KVQuantSettings", "KVQuantStore", "calibrate_kvquant",
           "index_dtype", "kmeans_1d", "outlier_count"]
