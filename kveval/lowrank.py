"""Low-rank K/V structure: calibrated per-head bases and the store that keeps only their coefficients.

MLA (DeepSeek-V2) shrinks the KV cache by caching a low-dimensional latent;
post-training methods (Palu, Eigen Attention, LoRC) approximate this on an
existing model by projecting K and V onto a few principal directions. Here,
per layer and KV head, keys and values each get an orthonormal basis
``B`` (``[head_dim, r]``); a token is stored as its ``r`` coefficients
``c = x B`` and read back as ``x_hat = c B^T``. As with quantization, tokens
are encoded when the cache seals them: the prefill's own attention is exact,
and everything that attends to the cache afterwards (question, generated
tokens) sees the reconstruction. The bases are per model, held in float32, and
are not counted in the cache's per-token bytes.

Keys are projected AFTER RoPE
------------------------------
Transformers' attention modules rotate the keys before ``cache.update``, so the
cache (and this store) only ever sees post-RoPE keys. Projecting them there
needs no modeling-code edit, and the coefficients reconstruct exactly the keys
attention uses, so the calibration is done on post-RoPE keys too. The cost:
RoPE rotates each channel pair by a position-dependent angle, which spreads a
pre-RoPE direction over its rotation plane, so post-RoPE keys are less low-rank
than pre-RoPE keys (why MLA uses a decoupled RoPE part and Palu/LoRC project
pre-RoPE). And the basis only covers the angles the calibration positions
(0 .. ``calib_tokens``) reached: slowly rotating pairs at positions far beyond
the calibration length may be reconstructed less well. Pre-RoPE projection
would require re-applying RoPE at read time from stored positions, i.e. a change
inside the attention module. Values carry no RoPE, so the question does not
arise for them.

Calibration
-----------
One forward pass over a calibration text (``kveval/data/calibration.txt`` by
default, at most ``calib_tokens`` tokens) in transformers' own cache layers
(plain ``DynamicLayer`` s for attention, sliding layers too, so every layer
keeps the whole pass; the model's own state layers for Mamba and linear
attention); the stored post-RoPE K/V of every attention layer are read from it. The calibration does
not go through kveval's own cache, so this module depends on the stores only. Per layer and KV
head, an *uncentered* PCA: eigendecomposition of ``X^T X / T`` (float64), so a
token's reconstruction is ``c B^T`` with no mean term. The full
eigendecomposition is cached on disk under ``cache_dir() / "calibration"``,
keyed by the model's identity (name, architecture fields, dtype and a hash of a
few K/V projection weights) and the calibration text's SHA-256, so every rank
or energy reuses one calibration and a changed text is calibrated again.

Models without a known tokenizer (random test models) are calibrated on the
text's UTF-8 bytes modulo the vocabulary size.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import pickle
import re
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from kveval.architectures import ATTENTION, HYBRID, NONE, STATE, cache_layer_plan, own_query_temperatures
from kveval.paths import cache_dir
from kveval.storage import DenseStore, QuantizedStore, TokenStore

CALIBRATION_VERSION = 1  # bump when the calibration procedure changes: old cache files are then ignored
DEFAULT_CALIBRATION = Path(__file__).parent / "data" / "calibration.txt"
DEFAULT_CALIB_TOKENS = 2048
_ENERGY_SLACK = 1e-9
_MEMORY: dict[str, "Calibration"] = {}  # in-process cache, keyed by the on-disk file path


# --- calibration text --------------------------------------------------------------------------
@dataclass(frozen=True)
class CalibrationText:
    """A calibration text, its source file and the SHA-256 of the file's bytes."""

    path: Path
    text: str
    sha256: str
    default: bool

    def calibration_id(self, tokens: int) -> str:
        label = "default" if self.default else self.path.name
        return f"{label}:sha256={self.sha256[:16]}:tokens={tokens}"


def read_calibration_text(path: str | os.PathLike | None = None) -> CalibrationText:
    """Read the calibration text (``None``: the shipped default, whose leading ``#`` header lines are skipped)."""
    source = DEFAULT_CALIBRATION if path is None else Path(path).expanduser()
    raw = source.read_bytes()
    text = raw.decode("utf-8", errors="replace")
    if path is None:
        lines = text.splitlines(keepends=True)
        while lines and lines[0].startswith("#"):
            lines.pop(0)
        text = "".join(lines).lstrip("\n")
    return CalibrationText(source, text, hashlib.sha256(raw).hexdigest(), path is None)


# --- model identity ----------------------------------------------------------------------------
_ARCH_FIELDS = ("model_type", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
                "hidden_size", "intermediate_size", "vocab_size", "max_position_embeddings", "rope_theta",
                "rope_scaling", "rope_parameters", "sliding_window", "layer_types", "query_pre_attn_scalar")


def model_name(model) -> str:
    """A readable name: kveval's model name, else the Hub id/folder, else the class name."""
    name = getattr(model, "kveval_name", None) or getattr(model.config, "_name_or_path", "") or type(model).__name__
    return re.sub(r"[^A-Za-z0-9._-]+", "-", str(name)).strip("-")[:64] or "model"


def model_fingerprint(model) -> str:
    """Hash of the architecture fields, the dtype and a few K/V projection weights (the first and last two)."""
    config = model.config.get_text_config()
    arch = {name: getattr(config, name, None) for name in _ARCH_FIELDS}
    h = hashlib.sha256(json.dumps([type(model).__name__, str(model.dtype), arch], sort_keys=True, default=str).encode())
    params = list(model.named_parameters())
    chosen = [(n, p) for n, p in params if n.endswith(("k_proj.weight", "v_proj.weight"))] or params
    chosen = chosen[:2] + chosen[-2:] if len(chosen) > 4 else chosen
    h.update(str(sum(p.numel() for _, p in params)).encode())
    for name, p in chosen:
        h.update(f"{name}:{tuple(p.shape)}".encode())
        h.update(p.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def tokenize_for(model, text: str) -> list[int]:
    """Token ids of ``text`` for ``model``: ``model.kveval_tokenizer`` (:func:`kveval.models.load_model` sets it),
    else the Hub tokenizer of its ``_name_or_path``, else bytes."""
    tokenizer = getattr(model, "kveval_tokenizer", None)
    path = getattr(model.config, "_name_or_path", "")
    if tokenizer is None and path:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as exc:
            raise ValueError(f"lowrank: cannot load a tokenizer for {path!r} to read the calibration text "
                             f"({str(exc).splitlines()[0]}); set model.kveval_tokenizer") from exc
    if tokenizer is None:
        vocab = model.config.get_text_config().vocab_size
        return [b % vocab for b in text.encode("utf-8")]
    # Calibration probes tokenize many times; loading Gemma-3's 262k-token tokenizer takes seconds each time.
    model.kveval_tokenizer = tokenizer
    return list(tokenizer(text)["input_ids"])


# --- calibration -------------------------------------------------------------------------------
def _calibration_cache(plans):
    """transformers' own cache layers for the calibration pass, every attention layer whole.

    Attention layers are plain ``DynamicLayer`` s, sliding ones too (they keep
    the whole pass); state and hybrid layers are the model's own conv/recurrent
    layers, which its Mamba or linear-attention modules need.
    """
    from transformers.cache_utils import (Cache, DummyLayer, DynamicLayer, LinearAttentionAndFullAttentionLayer,
                                          LinearAttentionLayer)

    kinds = {ATTENTION: lambda plan: DynamicLayer(), NONE: lambda plan: DummyLayer(),
             STATE: lambda plan: LinearAttentionLayer(number_of_states=plan.number_of_states),
             HYBRID: lambda plan: LinearAttentionAndFullAttentionLayer(number_of_states=plan.number_of_states)}
    return Cache(layers=[kinds[plan.kind](plan) for plan in plans])


def _collect_kv(model, ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """One forward pass with transformers' own cache; the stored (post-RoPE) K/V of every layer, ``[H, T, D]``, and
    ``None`` for a layer without K/V (a Mamba or linear-attention layer)."""
    plans = cache_layer_plan(model.config)
    cache = _calibration_cache(plans)
    with torch.no_grad(), own_query_temperatures(model):  # run on first use, maybe inside a forward kveval drives
        model(input_ids=ids, cache=cache, use_cache=True)
    return [(layer.keys[0].float().cpu(), layer.values[0].float().cpu()) if plan.holds_tokens else None
            for plan, layer in zip(plans, cache.layers)]


def uncentered_pca(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Eigenvalues ``[H, D]`` (descending, float64) and eigenvectors ``[H, D, D]`` (columns, float32) of ``x^T x / T``."""
    x = x.double()
    second_moment = x.transpose(-1, -2) @ x / max(1, x.shape[1])
    eigenvalues, eigenvectors = torch.linalg.eigh(second_moment)
    return eigenvalues.flip(-1).clamp(min=0), eigenvectors.flip(-1).float().contiguous()


@dataclass
class Calibration:
    """Per layer, the uncentered PCA of post-RoPE keys and of values for every KV head.

    ``spectra[kind][layer]`` is ``(eigenvalues [H, D], eigenvectors [H, D, D])``
    for ``kind`` in ``"k"``, ``"v"``; eigenvectors are columns, by descending eigenvalue.
    ``None`` for a layer without K/V (a hybrid model's Mamba or linear-attention layers).
    """

    spectra: dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]]
    tokens: int
    text_sha256: str
    model_key: str
    path: Path | None = None
    _bases: dict = field(default_factory=dict, repr=False)
    KIND: ClassVar[str] = ""  # part of the cache file's key (see :func:`calibration_path`)

    @property
    def num_layers(self) -> int:
        return len(self.spectra["k"])

    @property
    def kv_layers(self) -> list[int]:
        """The layers that hold K/V (every layer, except a hybrid model's state layers)."""
        return [layer for layer, spectrum in enumerate(self.spectra["k"]) if spectrum is not None]

    def head_dim(self, layer: int) -> int:
        return self.spectra["k"][layer][1].shape[-1]

    def num_heads(self, layer: int) -> int:
        return self.spectra["k"][layer][1].shape[0]

    def energy_ranks(self, kind: str, layer: int, energy: float) -> list[int]:
        """Per head, the smallest rank whose leading eigenvalues hold ``energy`` of the total."""
        eigenvalues = self.spectra[kind][layer][0]
        share = eigenvalues.cumsum(-1) / eigenvalues.sum(-1, keepdim=True).clamp(min=1e-300)
        reached = share >= energy - _ENERGY_SLACK
        return [int(row.nonzero()[0]) + 1 if bool(row.any()) else row.numel() for row in reached]

    def energy_kept(self, kind: str, layer: int, ranks: list[int]) -> list[float]:
        """Fraction of each head's calibration energy that its first ``ranks[h]`` directions hold."""
        eigenvalues = self.spectra[kind][layer][0]
        total = eigenvalues.sum(-1).clamp(min=1e-300)
        return [float(eigenvalues[h, :r].sum() / total[h]) for h, r in enumerate(ranks)]

    def layout(self, layer: int, key_ranks: list[int], value_ranks: list[int], device=None) -> list[tuple[slice, torch.Tensor, torch.Tensor]]:
        """Runs of heads with equal (K, V) ranks and their stacked bases ``[h, D, r]`` (float32, on ``device``).

        Memoized: every store of this layer shares the same basis tensors.
        """
        key = (layer, tuple(key_ranks), tuple(value_ranks), str(device))
        if key not in self._bases:
            kv, vv = self.spectra["k"][layer][1], self.spectra["v"][layer][1]
            runs, start, heads = [], 0, len(key_ranks)
            for h in range(1, heads + 1):
                if h == heads or (key_ranks[h], value_ranks[h]) != (key_ranks[start], value_ranks[start]):
                    rk, rv = key_ranks[start], value_ranks[start]
                    runs.append((slice(start, h), kv[start:h, :, :rk].contiguous().to(device),
                                 vv[start:h, :, :rv].contiguous().to(device)))
                    start = h
            self._bases[key] = runs
        return self._bases[key]

    def save(self, path: Path) -> None:
        """Write atomically (temporary file, then rename)."""
        save_atomic({"version": CALIBRATION_VERSION, "tokens": self.tokens, "text_sha256": self.text_sha256,
                     "model_key": self.model_key,
                     "spectra": {kind: [None if s is None else list(s) for s in layers]
                                 for kind, layers in self.spectra.items()}}, path)

    @classmethod
    def load(cls, path: Path) -> "Calibration | None":
        """The calibration stored at ``path``, or ``None`` if it is missing, unreadable or of another version."""
        payload = load_versioned(path, CALIBRATION_VERSION)
        if payload is None:
            return None
        spectra = {kind: [None if s is None else tuple(s) for s in layers] for kind, layers in payload["spectra"].items()}
        return cls(spectra, payload["tokens"], payload["text_sha256"], payload["model_key"], path)

    @classmethod
    def calibrate(cls, model, text: CalibrationText, tokens: int, model_key: str = "") -> "Calibration":
        return calibrate(model, text, tokens, model_key)


def save_atomic(payload: dict, path: Path) -> None:
    """``torch.save`` to a temporary file next to ``path``, then rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    os.close(fd)
    try:
        torch.save(payload, tmp)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def load_versioned(path: Path, version: int) -> dict | None:
    """The dict saved at ``path`` when it is readable and of ``version``, else ``None``.

    A damaged or foreign file is ``None`` (a cache entry to compute again), whatever
    torch's reader raises on it: truncated pickles raise ``struct.error``,
    refused globals ``pickle.UnpicklingError``.
    """
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, EOFError, ValueError, pickle.UnpicklingError, struct.error):
        return None
    if not isinstance(payload, dict) or payload.get("version") != version:
        return None
    return payload


def calibration_path(model, text: CalibrationText, tokens: int, kind: str = "") -> tuple[Path, str]:
    """Where the calibration of ``model`` on ``text`` lives, and the model key used.

    ``kind`` names another statistic of the same pass (``""``: the per-head PCA
    of this module; :mod:`kveval.latent` keeps cross-head second moments).
    """
    model_key = model_fingerprint(model)
    kind_key = f":{kind}" if kind else ""
    key = hashlib.sha256(f"{CALIBRATION_VERSION}:{model_key}:{text.sha256}:{tokens}{kind_key}".encode()).hexdigest()[:20]
    suffix = f"-{kind}" if kind else ""
    return cache_dir() / "calibration" / f"{model_name(model)}{suffix}-{key}.pt", model_key


def calibration_kv(model, text: CalibrationText, tokens: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor] | None], int]:
    """The calibration pass: post-RoPE K/V ``[H, T, D]`` (float32) of every layer (``None`` for a layer without
    K/V), and ``T``, the tokens used."""
    ids = tokenize_for(model, text.text)
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    ids = ids[: min(tokens, limit or tokens)]
    if len(ids) < 2:
        raise ValueError(f"lowrank: calibration text {text.path} gives {len(ids)} token(s); it needs at least 2")
    return _collect_kv(model, torch.tensor([ids], dtype=torch.long, device=model.device)), len(ids)


def calibrate(model, text: CalibrationText, tokens: int, model_key: str = "") -> Calibration:
    """Run the calibration pass: one forward over at most ``tokens`` tokens of ``text``, PCA per layer and head."""
    kv, used = calibration_kv(model, text, tokens)
    spectra = {kind: [None if pair is None else uncentered_pca(pair[side]) for pair in kv]
               for side, kind in enumerate(("k", "v"))}
    return Calibration(spectra, used, text.sha256, model_key)


def load_or_calibrate(model, text: CalibrationText, tokens: int, kind: type = Calibration):
    """The cached calibration for ``model`` and ``text`` (memory, then disk), else calibrate and store it.

    ``kind`` is the calibration class: :class:`Calibration` (per-head PCA) or
    another with the same ``KIND``/``load``/``calibrate``/``save`` protocol
    (:class:`kveval.latent.CrossHeadCalibration`).
    """
    path, model_key = calibration_path(model, text, tokens, kind.KIND)
    return load_or_compute(
        _MEMORY, path, kind.load,
        fits=lambda cached: cached.text_sha256 == text.sha256 and cached.model_key == model_key,
        compute=lambda: kind.calibrate(model, text, tokens, model_key),
    )


def load_or_compute(memory: dict, path: Path, load, fits, compute):
    """A calibration cached at ``path``: from ``memory``, else from disk, else computed, saved and remembered.

    ``load(path)`` reads the file (``None`` when it cannot); a loaded object
    that ``fits(obj)`` rejects (another text or model) is recomputed.
    ``compute()`` returns an object with ``save(path)`` and a ``path`` attribute.
    ``memory`` maps ``str(path)`` to the object for the rest of the process.
    """
    cached = memory.get(str(path))
    if cached is None:
        cached = load(path) if path.is_file() else None
        if cached is None or not fits(cached):
            cached = compute()
            cached.save(path)
            cached.path = path
        memory[str(path)] = cached
    return cached


def clear_memory_cache() -> None:
    """Forget calibrations held in this process (the on-disk cache stays)."""
    _MEMORY.clear()


# --- the store ---------------------------------------------------------------------------------
@dataclass
class _Part:
    """Contiguous KV heads with the same K and V ranks, stored in one inner store."""

    heads: slice
    inner: object
    key_basis: torch.Tensor  # [h, D, r_k], float32
    value_basis: torch.Tensor  # [h, D, r_v], float32
    bases_t: tuple | None = field(default=None, repr=False, compare=False)  # see transposed()

    def transposed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The bases as contiguous ``[h, r, D]`` (what :func:`reconstruct` multiplies by), made once per device."""
        if self.bases_t is None or self.bases_t[0].device != self.key_basis.device:
            self.bases_t = (self.key_basis.transpose(-1, -2).contiguous(), self.value_basis.transpose(-1, -2).contiguous())
        return self.bases_t


_RECONSTRUCT_TOKENS = 256  # at most this many tokens per elementwise product in reconstruct ...
_RECONSTRUCT_ELEMENTS = 1 << 24  # ... and at most this many elements (64 MiB) in its [..., T, r, D] temporary


def reconstruct(coefficients: torch.Tensor, basis_t: torch.Tensor) -> torch.Tensor:
    """``[..., h, T, r]`` float32 coefficients times a contiguous ``[h, r, D]`` basis: ``[..., h, T, D]``.

    Elementwise products summed over the rank, not a matrix product: a matmul's blocking follows the matrix
    sizes, so a token reconstructed alone, with the rest of its row or with other rows could differ in the last
    bit; this way a token's K/V are the same whichever tokens and rows are reconstructed with it (a decode
    step's one new token, a whole row, a batch). Chunks of tokens bound the temporary.
    """
    basis = basis_t[:, None]  # [h, 1, r, D]
    tokens = coefficients.shape[-2]
    per_token = coefficients.numel() // max(1, tokens) * basis_t.shape[-1]  # temporary elements per token
    step = max(1, min(_RECONSTRUCT_TOKENS, _RECONSTRUCT_ELEMENTS // max(1, per_token)))
    chunks = [(coefficients[..., start:start + step, :, None] * basis).sum(dim=-2) for start in range(0, tokens, step)]
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks, dim=-2)


class CoefficientStore(TokenStore):
    """Tokens kept as coefficients in inner stores, encoded when the cache seals them.

    The mechanics shared by :class:`LowRankStore` (per-head bases) and
    :class:`kveval.latent.LatentStore` (one basis per group of heads):
    ``append(keys, values)`` holds the ``[H, T, D]`` tensors as they come
    (post-RoPE keys: the cache receives keys after RoPE) in a dense store in
    the inner stores' ``kv_dtype``; ``seal()`` encodes them (:meth:`encode`)
    and appends the coefficients to the inner stores (``DenseStore``, which holds
    them in its ``kv_dtype``, or a ``QuantizedStore`` that then quantizes them);
    ``keys_values()`` decodes them (:meth:`decode`), followed by any tokens not
    sealed yet. ``nbytes`` is the inner stores' bytes (plus unsealed tokens):
    the per-token coefficients only, never the per-model bases.

    Incremental reads (:meth:`changed_from`): a token's decoded K/V depend on its
    own coefficients alone, so once read they change only where an inner store
    says its coefficients changed (a quantizer sealing its residual) or when the
    token itself is sealed; a decode step re-decodes its new tokens, not the row.
    """

    def __init__(self, inners: list):
        self.inners = inners
        self.kv_dtype = getattr(inners[0], "kv_dtype", None)
        self.unsealed = DenseStore(self.kv_dtype)  # [H, T, D] tokens appended but not encoded yet
        self._sealed_read = 0  # sealed tokens at the last mark_read: later ones were shown unsealed, or not at all

    def encode(self, keys: torch.Tensor, values: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """``[..., H, T, D]`` keys and values -> K and V coefficients for each inner store, in the inputs' dtype.

        Leading dims are rows of a batch (a batched decode step encodes every row's new token with the first
        row's store); a token's coefficients are the same encoded alone (one row, ``T = 1``) or in a batch."""
        raise NotImplementedError

    def decode(self, coefficients: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        """Coefficients of each inner store -> ``[..., H, T, D]`` keys and values, in the coefficients' dtype;
        a token's K/V depend on its own coefficients alone, bit for bit (:func:`reconstruct`)."""
        raise NotImplementedError

    def same_code(self, other: "CoefficientStore") -> bool:
        """Whether ``other`` encodes and decodes as this store does (same class and bases): a batch of such rows
        may be encoded by one of them."""
        raise NotImplementedError

    def inner_index(self, i: int, index: torch.Tensor) -> torch.Tensor:
        """The rows of a per-head ``select`` index (``[H, T']``) that inner store ``i`` keeps."""
        raise NotImplementedError

    @property
    def length(self) -> int:
        return self.inners[0].length + self.unsealed.length

    def append(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        self.unsealed.append(keys, values)

    def seal(self) -> None:
        if self.unsealed.length:
            for inner, (ck, cv) in zip(self.inners, self.encode(*self.unsealed.keys_values())):
                inner.append(ck, cv)
            self.unsealed = DenseStore(self.kv_dtype)
        for inner in self.inners:
            inner.seal()

    def coefficients(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The stored (dequantized) coefficients of each inner store (sealed tokens only)."""
        return [inner.keys_values() for inner in self.inners]

    def keys_values(self) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.inners[0].length:
            return self.unsealed.keys_values()
        keys, values = self.decode(self.coefficients())
        if self.unsealed.length:
            pending_keys, pending_values = self.unsealed.keys_values()
            keys = torch.cat([keys, pending_keys], dim=1)
            values = torch.cat([values, pending_values], dim=1)
        return keys, values

    def changed_from(self) -> int:
        return min([self._sealed_read] + [inner.changed_from() for inner in self.inners])

    def mark_read(self) -> None:
        self._sealed_read = self.inners[0].length
        for inner in self.inners:
            inner.mark_read()

    def keys_values_from(self, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        sealed = self.inners[0].length
        if start >= sealed:
            return self.unsealed.keys_values_from(start - sealed)
        keys, values = self.decode([inner.keys_values_from(start) for inner in self.inners])
        if self.unsealed.length:
            pending_keys, pending_values = self.unsealed.keys_values()
            keys = torch.cat([keys, pending_keys], dim=1)
            values = torch.cat([values, pending_values], dim=1)
        return keys, values

    def select(self, index: torch.Tensor) -> None:
        self._sealed_read = 0
        if self.unsealed.length and self.inners[0].length:
            self.seal()  # mixed sealed and unsealed tokens (the cache never selects then): encode first
        if self.unsealed.length:
            self.unsealed.select(index)
        else:
            for i, inner in enumerate(self.inners):
                inner.select(self.inner_index(i, index))

    @property
    def nbytes(self) -> int:
        return sum(inner.nbytes for inner in self.inners) + self.unsealed.nbytes


class LowRankStore(CoefficientStore):
    """Keeps each token's K and V as coefficients on per-head bases, in an inner store.

    A :class:`CoefficientStore` whose code is ``c = x B`` per KV head
    (``[H, T, r]`` coefficients) and whose reconstruction is ``c B^T``. Heads
    whose ranks differ (``energy=``) are kept in separate inner stores (parts).
    The bases are per model (see
    :meth:`kveval.policies.lowrank.LowRankPolicy.basis_bytes`).
    """

    def __init__(self, parts: list[_Part]):
        super().__init__([part.inner for part in parts])
        self.parts = parts

    @classmethod
    def build(cls, inner, layout: list[tuple[slice, torch.Tensor, torch.Tensor]]) -> "LowRankStore":
        """A store over ``layout`` (from :meth:`Calibration.layout`): the first run of heads uses ``inner``,
        the others empty copies of it."""
        if inner.length:
            raise ValueError("LowRankStore needs an empty inner store")
        return cls([_Part(heads, inner if i == 0 else copy.deepcopy(inner), kb, vb)
                    for i, (heads, kb, vb) in enumerate(layout)])

    @staticmethod
    def _basis_on(part: _Part, device) -> None:
        if part.key_basis.device != device:
            part.key_basis, part.value_basis = part.key_basis.to(device), part.value_basis.to(device)

    def project(self, keys: torch.Tensor, values: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Coefficients ``x B`` of each part, ``[..., h, T, r]``, in the inputs' dtype (``[..., H, T, D]`` inputs:
        one row, or a batch of rows' new tokens, :class:`kveval.buffered_decode.BufferedDecode`)."""
        out = []
        for part in self.parts:
            self._basis_on(part, keys.device)
            out.append((torch.matmul(keys[..., part.heads, :, :].float(), part.key_basis).to(keys.dtype),
                        torch.matmul(values[..., part.heads, :, :].float(), part.value_basis).to(values.dtype)))
        return out

    encode = project

    def decode(self, coefficients: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = [], []
        for part, (ck, cv) in zip(self.parts, coefficients):
            key_t, value_t = part.transposed()
            keys.append(reconstruct(ck.float(), key_t).to(ck.dtype))
            values.append(reconstruct(cv.float(), value_t).to(cv.dtype))
        keys = keys[0] if len(keys) == 1 else torch.cat(keys, dim=-3)
        values = values[0] if len(values) == 1 else torch.cat(values, dim=-3)
        return keys, values

    def inner_index(self, i: int, index: torch.Tensor) -> torch.Tensor:
        return index[self.parts[i].heads]

    def same_code(self, other: CoefficientStore) -> bool:
        return (type(other) is LowRankStore and len(other.parts) == len(self.parts)
                and all(p.heads == q.heads and torch.equal(p.key_basis, q.key_basis) and torch.equal(p.value_basis, q.value_basis)
                        for p, q in zip(self.parts, other.parts)))

    def __deepcopy__(self, memo) -> "LowRankStore":
        # Bases are per model and read-only: copies share them; coefficients and pending tokens are copied.
        clone = LowRankStore([_Part(p.heads, copy.deepcopy(p.inner, memo), p.key_basis, p.value_basis) for p in self.parts])
        clone.unsealed = copy.deepcopy(self.unsealed, memo)
        return clone


def per_token_groups(inner) -> dict[str, int | None]:
    """For a quantized inner store, the per-token group size of K and V (``None``: not per-token or not quantized)."""
    groups = {"k": None, "v": None}
    if isinstance(inner, QuantizedStore):
        for kind, seq in (("k", inner.k), ("v", inner.v)):
            if seq.quant.axis == "token":
                groups[kind] = seq.quant.group
    return groups


def round_up(rank: int, multiple: int | None, limit: int) -> int:
    """``rank`` rounded up to a multiple of ``multiple`` (at most ``limit``)."""
    if not multiple:
        return rank
    return min(limit, math.ceil(rank / multiple) * multiple)


__all__ = ["Calibration", "CalibrationText", "CoefficientStore", "LowRankStore", "calibrate", "calibration_kv",
           "clear_memory_cache", "load_or_calibrate", "load_or_compute", "load_versioned", "model_fingerprint",
           "read_calibration_text", "save_atomic", "uncentered_pca"]
