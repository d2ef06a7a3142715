"""Retrieval heads after DuoAttention, identified on generated passkey probes and cached per model.

DuoAttention (Xiao et al. 2024, "DuoAttention: Efficient Long-Context LLM
Inference with Retrieval and Streaming Heads") learns one gate per KV head by
optimizing, on synthetic passkey data, how much each head's full attention
matters to the output; heads with high gates are *retrieval heads* and keep
the whole cache, the others keep attention sinks plus a recent window.

kveval does not optimize gates. As a cheap, honest stand-in it scores every
KV head by the attention mass the queries that produce the answer of a
passkey probe put on the needle's tokens (averaged over the query heads that
share the KV head, over the answer's tokens and over three needle depths):
a head that reads the needle when the answer is written is one retrieval
needs. This is a heuristic (attention mass, not the output effect the gates
measure), stated as such wherever :mod:`kveval.policies.duo` is used.

The probe is generated (public-domain style repeated filler, a 5-digit pass
key) in the model's own tokens; scores are cached on disk under
``cache_dir() / "calibration"``, keyed by the model's fingerprint, the probe
length and :data:`CALIBRATION_VERSION`.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path

import torch

from kveval.calibration.kv import (
    load_or_compute,
    load_versioned,
    model_fingerprint,
    model_name,
    save_atomic,
    tokenize_for,
)
from kveval.errors import UsageError
from kveval.modeling.architectures import own_query_temperatures
from kveval.paths import cache_dir
from kveval.probes.text import REPEAT_SENTENCES

#: Builds the cache calibration runs the model with: ``(model, window) ->`` a
#: :class:`kveval.cache.compressed.CompressedCache` that keeps SnapKV's attention of the last ``window`` queries. The
#: cache module hands it over here when it loads (:func:`use_cache`). Handed over, not imported: the cache imports the
#: policies, whose DuoAttention calls this module, so an import would close a cycle.
_calibration_cache = None


def use_cache(make_cache) -> None:
    """Calibrate with the caches ``make_cache(model, window)`` builds (see :data:`_calibration_cache`)."""
    global _calibration_cache
    _calibration_cache = make_cache

CALIBRATION_VERSION = 1
DEPTHS = (0.2, 0.5, 0.8)
_MEMORY: dict[str, "RetrievalScores"] = {}


@dataclass
class RetrievalScores:
    """Per layer and KV head, the mean attention mass answer queries put on the needle (``nan``: a layer selection skips).

    ``scores`` is ``[layers, kv_heads]`` float32, each in ``[0, 1]``.
    """

    scores: torch.Tensor
    tokens: int
    model_key: str
    path: Path | None = None

    def retrieval_mask(self, fraction: float, scope: str) -> torch.Tensor:
        """``[layers, kv_heads]`` bool: the top ``ceil(fraction x heads)`` heads, over all layers or in each.

        Layers selection skips (``nan``: sliding layers beside full ones) are never chosen.
        Ties are broken by layer and head order.
        """
        import math

        scored = torch.nan_to_num(self.scores, nan=-1.0)
        mask = torch.zeros_like(scored, dtype=torch.bool)
        if scope == "global":
            valid = ~self.scores.isnan()
            count = math.ceil(fraction * int(valid.sum()))
            if count:
                mask.view(-1)[scored.flatten().topk(count, sorted=True).indices] = True
            return mask & valid
        count = math.ceil(fraction * scored.shape[1])
        for layer in range(scored.shape[0]):
            if count and not bool(self.scores[layer].isnan().all()):
                mask[layer, scored[layer].topk(count).indices] = True
        return mask

    def save(self, path: Path) -> None:
        """Write atomically (temporary file, then rename)."""
        save_atomic({"version": CALIBRATION_VERSION, "scores": self.scores, "tokens": self.tokens,
                     "model_key": self.model_key}, path)

    @classmethod
    def load(cls, path: Path) -> "RetrievalScores | None":
        """The scores stored at ``path``, or ``None`` if missing, unreadable or of another version."""
        payload = load_versioned(path, CALIBRATION_VERSION)
        if payload is None:
            return None
        return cls(payload["scores"], payload["tokens"], payload["model_key"], path)


def passkey_probe(model, tokens: int, depth: float, seed: int = 0) -> tuple[list[int], slice, int]:
    """A passkey probe of about ``tokens`` tokens: its ids (answer included), the needle's token span, answer length."""
    rng = random.Random(seed)
    key = "".join(str(rng.randrange(10)) for _ in range(5))
    needle = f" The pass key is {key}. Remember it. {key} is the pass key."
    intro = "There is an important info hidden inside a lot of irrelevant text. Find it and memorize it."
    sentences, filler = [], 0
    while filler < tokens:
        sentences.append(" " + REPEAT_SENTENCES[len(sentences) % len(REPEAT_SENTENCES)])
        filler = len(tokenize_for(model, intro + "".join(sentences)))
    cut = max(1, round(depth * len(sentences)))
    before = intro + "".join(sentences[:cut])
    question = before + needle + "".join(sentences[cut:]) + "\nWhat is the pass key? The pass key is"
    start, stop = len(tokenize_for(model, before)), len(tokenize_for(model, before + needle))
    prompt = tokenize_for(model, question)
    ids = tokenize_for(model, question + " " + key)
    # Boundary merges may shift a token: widen the needle span by one on each side.
    return ids, slice(max(0, start - 1), stop + 1), max(1, len(ids) - len(prompt))


def calibrate(model, tokens: int, model_key: str = "") -> RetrievalScores:
    """Score every KV head on passkey probes at :data:`DEPTHS` (one forward pass each)."""
    if _calibration_cache is None:
        raise RuntimeError("retrieval heads calibrate through kveval.cache.compressed: import it first")
    total = None
    for i, depth in enumerate(DEPTHS):
        ids, needle, answer = passkey_probe(model, tokens, depth, seed=i)
        # The last `answer` queries of ids[:-1] are those that write the answer's tokens.
        cache = _calibration_cache(model, answer)
        _check_within_windows(cache, tokens, len(ids) - 1)
        with torch.no_grad(), own_query_temperatures(model):  # run on first use, maybe inside a forward kveval drives
            model(input_ids=torch.tensor([ids[:-1]], device=model.device), cache=cache, use_cache=True)
        per_layer = []
        for layer in cache.layers:
            rows = getattr(layer, "rows", None)
            scores = rows[0].scores if rows and layer.takes_selection else None
            if not scores:
                per_layer.append(torch.full((cache.num_kv_heads,), float("nan")))
                continue
            mass = next(iter(scores.values())).float().cpu()
            per_layer.append(mass[:, needle].sum(dim=1) / answer)
        scores = torch.stack(per_layer)
        total = scores if total is None else total + scores
    return RetrievalScores(total / len(DEPTHS), tokens, model_key)


def _check_within_windows(cache, tokens: int, length: int) -> None:
    """Refuse probes longer than a sliding window that selection acts on (every layer of the model slides): the
    needle's tokens would leave the window before the answer's queries read them, and the heads would be ranked on
    nothing (:attr:`~kveval.cache.layers.CompressedLayer.takes_selection`)."""
    windows = [layer.sliding_window for layer in cache.attention_layers if layer.is_sliding and layer.takes_selection]
    if windows and length >= min(windows):
        room = min(windows) - (length - tokens) - 1
        raise UsageError(f"duo(calib_tokens={tokens}): its passkey probes ({length} tokens) reach past the model's "
                         f"{min(windows)}-token sliding window, so the needle would leave the window before the answer "
                         f"reads it; give calib_tokens={room} or fewer" if room > 0 else
                         f"duo: the model's {min(windows)}-token sliding window is shorter than a passkey probe; "
                         f"give heads=0 or heads=1 (nothing to rank)")


def load_or_calibrate(model, tokens: int) -> RetrievalScores:
    """The model's retrieval scores from memory, then disk, else computed once and stored."""
    model_key = model_fingerprint(model)
    key = hashlib.sha256(f"duo:{CALIBRATION_VERSION}:{model_key}:{tokens}".encode()).hexdigest()[:20]
    path = cache_dir() / "calibration" / f"{model_name(model)}-duo-{key}.pt"
    return load_or_compute(
        _MEMORY, path, RetrievalScores.load,
        fits=lambda cached: cached.model_key == model_key,
        compute=lambda: calibrate(model, tokens, model_key),
    )


def clear_memory_cache() -> None:
    """Forget scores held in this process (the on-disk cache stays)."""
    _MEMORY.clear()


__all__ = ["RetrievalScores", "calibrate", "clear_memory_cache", "load_or_calibrate", "passkey_probe", "use_cache"]
