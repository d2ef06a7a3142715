"""Calibration K/V: the calibration text, the activations it gives, low-rank bases fitted on them, and their cache on disk and in memory."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import struct
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import ClassVar

import torch

from kveval.errors import UsageError
from kveval.modeling.architectures import (
    ATTENTION,
    HYBRID,
    NATIVE,
    NONE,
    STATE,
    cache_layer_plan,
    own_query_temperatures,
)
from kveval.modeling.layer_types import NATIVE_ENTRY_PARTS
from kveval.paths import DEFAULT_CALIBRATION, cache_dir

CALIBRATION_VERSION = 1  # bump when the calibration procedure changes: old cache files are then ignored
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
    """Token ids of ``text`` for ``model``: ``model.kveval_tokenizer`` (:func:`kveval.runner.models.load_model` sets it),
    else the Hub tokenizer of its ``_name_or_path``, else bytes."""
    tokenizer = getattr(model, "kveval_tokenizer", None)
    path = getattr(model.config, "_name_or_path", "")
    if tokenizer is None and path:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(path)
        except (OSError, ValueError) as exc:
            raise UsageError(f"lowrank: cannot load a tokenizer for {path!r} to read the calibration text "
                             f"({str(exc).splitlines()[0]}); set model.kveval_tokenizer") from exc
    if tokenizer is None:
        vocab = model.config.get_text_config().vocab_size
        return [b % vocab for b in text.encode("utf-8")]
    # Calibration probes tokenize many times; loading Gemma-3's 262k-token tokenizer takes seconds each time.
    model.kveval_tokenizer = tokenizer
    return list(tokenizer(text)["input_ids"])


# --- calibration -------------------------------------------------------------------------------
def _calibration_cache(model, plans, tokens: int):
    """transformers' own cache layers for the calibration pass of ``tokens`` tokens, every attention layer whole.

    Attention layers are plain ``DynamicLayer`` s, sliding ones too (they keep
    the whole pass); state and hybrid layers are the model's own conv/recurrent
    layers, which its Mamba or linear-attention modules need. A model whose own
    layers hold more than K/V (DeepSeek V3.2, GLM MoE-DSA, V4: ``NATIVE`` plans)
    gets its own cache, built from its config with windows longer than the pass,
    so that its sliding layers keep every entry too.
    """
    from transformers.cache_utils import (
        Cache,
        DummyLayer,
        DynamicCache,
        DynamicLayer,
        LinearAttentionAndFullAttentionLayer,
        LinearAttentionLayer,
    )

    if any(plan.kind == NATIVE for plan in plans):
        import copy

        config = copy.deepcopy(model.config)
        text = config.get_text_config(decoder=True)
        if getattr(text, "sliding_window", None):
            # One forward: the mask comes from the model's own config, the window only trims what is kept after it.
            text.sliding_window = tokens + 1
        return DynamicCache(config=config)
    kinds = {ATTENTION: lambda plan: DynamicLayer(), NONE: lambda plan: DummyLayer(),
             STATE: lambda plan: LinearAttentionLayer(number_of_states=plan.number_of_states),
             HYBRID: lambda plan: LinearAttentionAndFullAttentionLayer(number_of_states=plan.number_of_states)}
    return Cache(layers=[kinds[plan.kind](plan) for plan in plans])


#: Per layer: its stored K/V, ``[H, T, D]`` each (``None`` for a layer without K/V).
KVPairs = list[tuple[torch.Tensor, torch.Tensor] | None]
#: Per layer: a native layer's other parts by name (``[1, n, width]``, float32; empty for other layers).
KVParts = list[dict[str, torch.Tensor]]


def _native_layer_kv(plan, layer) -> tuple[tuple[torch.Tensor, torch.Tensor], dict[str, torch.Tensor]]:
    """A native cache layer's store part (V3.2's latent and RoPE key; V4's window of K=V entries, with values of
    width 0, as kveval stores them) and its other parts (the indexer's keys, V4's compressed entries)."""
    keys = layer.keys[0].float().cpu()
    if plan.layer_type == "indexed_attention":
        indexer = layer.indexer_keys  # None where the layer reuses an earlier layer's top-k (GLM's "shared")
        return (keys, layer.values[0].float().cpu()), {} if indexer is None else {"indexer": indexer[:1].float().cpu()}
    empty = keys[:, :0, :0]  # a series that emitted no entry yet (the pass is shorter than its window)
    parts = {part: empty if layer.compressed_kv[name] is None else layer.compressed_kv[name][:1].float().cpu()
             for name, part in NATIVE_ENTRY_PARTS.get(plan.layer_type, {}).items()}
    return (keys, keys[..., :0]), parts


def _collect_kv(model, ids: torch.Tensor) -> tuple[KVPairs, KVParts]:
    """One forward pass with transformers' own cache; the stored (post-RoPE) K/V of every layer, ``[H, T, D]``, and
    ``None`` for a layer without K/V (a Mamba or linear-attention layer); and each native layer's other parts."""
    plans = cache_layer_plan(model.config)
    cache = _calibration_cache(model, plans, ids.shape[1])
    with torch.no_grad(), own_query_temperatures(model):  # run on first use, maybe inside a forward kveval drives
        model(input_ids=ids, cache=cache, use_cache=True)
    pairs, parts = [], []
    for plan, layer in zip(plans, cache.layers):
        if plan.kind == NATIVE:
            pair, others = _native_layer_kv(plan, layer)
        else:
            pair = (layer.keys[0].float().cpu(), layer.values[0].float().cpu()) if plan.holds_tokens else None
            others = {}
        pairs.append(pair)
        parts.append(others)
    return pairs, parts


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


@dataclass
class KVAmax:
    """Per layer, the largest magnitude of the calibration pass's post-RoPE K and of its V (float32; ``None`` for a
    layer without K/V): what the engine presets' per-tensor scales come from (:mod:`kveval.policies.engines`).
    Rounding to a 16-bit dtype is monotonic, so the amax of K rounded to it is this amax rounded to it."""

    k: list[float | None]
    v: list[float | None]
    tokens: int
    text_sha256: str
    model_key: str
    path: Path | None = None
    KIND: ClassVar[str] = "amax"

    def save(self, path: Path) -> None:
        save_atomic({"version": CALIBRATION_VERSION, "k": self.k, "v": self.v, "tokens": self.tokens,
                     "text_sha256": self.text_sha256, "model_key": self.model_key}, path)

    @classmethod
    def load(cls, path: Path) -> "KVAmax | None":
        payload = load_versioned(path, CALIBRATION_VERSION)
        if payload is None:
            return None
        return cls(payload["k"], payload["v"], payload["tokens"], payload["text_sha256"], payload["model_key"], path)

    @classmethod
    def calibrate(cls, model, text: CalibrationText, tokens: int, model_key: str = "") -> "KVAmax":
        kv, used = calibration_kv(model, text, tokens)

        def peak(x: torch.Tensor) -> float:
            return float(x.abs().amax())

        return cls([None if p is None else peak(p[0]) for p in kv], [None if p is None else peak(p[1]) for p in kv],
                   used, text.sha256, model_key)


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
    of this module; :mod:`kveval.stores.latent` keeps cross-head second moments).
    """
    model_key = model_fingerprint(model)
    kind_key = f":{kind}" if kind else ""
    key = hashlib.sha256(f"{CALIBRATION_VERSION}:{model_key}:{text.sha256}:{tokens}{kind_key}".encode()).hexdigest()[:20]
    suffix = f"-{kind}" if kind else ""
    return cache_dir() / "calibration" / f"{model_name(model)}{suffix}-{key}.pt", model_key


def calibration_kv(model, text: CalibrationText, tokens: int) -> tuple[KVPairs, int]:
    """The calibration pass: post-RoPE K/V ``[H, T, D]`` (float32) of every layer (``None`` for a layer without
    K/V), and ``T``, the tokens used."""
    pairs, _, used = calibration_kv_parts(model, text, tokens)
    return pairs, used


def calibration_kv_parts(model, text: CalibrationText, tokens: int) -> tuple[KVPairs, KVParts, int]:
    """:func:`calibration_kv`, and each native layer's other parts (DeepSeek V3.2's indexer keys, V4's compressed
    entries and their indexer keys: ``[1, n, width]``, float32, by part name; ``{}`` for other layers)."""
    ids = tokenize_for(model, text.text)
    limit = getattr(model.config.get_text_config(), "max_position_embeddings", None)
    ids = ids[: min(tokens, limit or tokens)]
    if len(ids) < 2:
        raise UsageError(f"lowrank: calibration text {text.path} gives {len(ids)} token(s); it needs at least 2")
    pairs, parts = _collect_kv(model, torch.tensor([ids], dtype=torch.long, device=model.device))
    return pairs, parts, len(ids)


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
    (:class:`kveval.stores.latent.CrossHeadCalibration`).
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


