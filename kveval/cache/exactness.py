"""Is kveval's uncompressed path exact on this model? The load-time self-check.

Policy ``none`` through kveval's cache and attention must give the logits of
the model's own eager attention with its own ``DynamicCache``; otherwise every
baseline and comparison on that model would be silently wrong. The probe: a
prefill of ``prefill`` random token ids (24; DeepSeek V4: past its window and its
widest compressor's window, :func:`probe_length`), then ``decode`` greedy single-token
steps, logits compared at every step. Stored tokens are kept in the model's
compute dtype here (``kv_dtype`` = model dtype), so the probe measures attention
and caching, not the deployment's storage precision.

Tolerance (absolute, on logits): ``1e-3 x max(1, max |reference logit|)`` for a
float32 model, ``3e-2 x`` that scale for 16-bit models (SDPA and eager round
differently in bfloat16). A wrong attention variant is orders of magnitude
above both (gpt-oss's sinks ignored: 0.28 on a tiny random model).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kveval.cache.attention import ATTENTION_NAME
from kveval.cache.compressed import CompressedCache
from kveval.errors import UnsupportedModelError
from kveval.modeling.architectures import architecture_name

FLOAT32_TOLERANCE = 1e-3
HALF_TOLERANCE = 3e-2


@dataclass(frozen=True)
class Exactness:
    """Largest absolute logit difference between kveval (``none``) and the model's eager attention."""

    max_difference: float
    reference_scale: float  # max(1, largest |reference logit|)
    tolerance: float

    @property
    def exact(self) -> bool:
        return self.max_difference <= self.tolerance


def prefill_and_decode(model, cache, ids: torch.Tensor, decode: int) -> list[torch.Tensor]:
    """Prefill ``ids`` then ``decode`` greedy steps; the logits of every forward."""
    length = ids.shape[1]
    out = [model(ids, cache=cache, use_cache=True, position_ids=torch.arange(length, device=ids.device)[None]).logits]
    nxt = out[0][:, -1:].argmax(-1)
    for step in range(decode):
        position = torch.tensor([[length + step]], device=ids.device)
        out.append(model(nxt, cache=cache, use_cache=True, position_ids=position).logits)
        nxt = out[-1][:, -1:].argmax(-1)
    return out


@torch.no_grad()
def measure_exactness(model, prefill: int = 24, decode: int = 4, seed: int = 0) -> Exactness:
    """Run the probe on ``model`` (loaded with ``attn_implementation="kveval"``) and return the difference."""
    from transformers import DynamicCache

    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(min(3, vocab - 1), vocab, (1, prefill), generator=torch.Generator().manual_seed(seed))
    ids = ids.to(model.device)
    ours = prefill_and_decode(model, CompressedCache(model, kv_dtype=model.dtype), ids, decode)
    model.set_attn_implementation("eager")
    try:
        reference = prefill_and_decode(model, DynamicCache(config=model.config), ids, decode)
    finally:
        model.set_attn_implementation(ATTENTION_NAME)
    difference = max(float((a.float() - b.float()).abs().max()) for a, b in zip(ours, reference))
    scale = max(1.0, max(float(b.float().abs().max()) for b in reference))
    relative = FLOAT32_TOLERANCE if model.dtype == torch.float32 else HALF_TOLERANCE
    return Exactness(difference, scale, relative * scale)


def probe_length(config, prefill: int = 24) -> int:
    """The self-check's prefill: 24 tokens, or for DeepSeek V4 enough to pass its window and close a window of its
    widest compressor with tokens left pending (so the probe reaches every part of its cache)."""
    text = config.get_text_config(decoder=True)
    if getattr(text, "model_type", None) != "deepseek_v4":
        return prefill
    rates = (getattr(text, "compress_rates", None) or {}).values()
    return max(prefill, (text.sliding_window or 0) + max(rates, default=0) + 3)


def self_check(model) -> Exactness:
    """Refuse (:class:`UnsupportedModelError`, one line) a model on which kveval's ``none`` is not exact."""
    result = measure_exactness(model, prefill=probe_length(model.config))
    if not result.exact:
        raise UnsupportedModelError(
            f"{architecture_name(model.config)}: kveval's uncompressed attention differs from the model's eager attention "
            f"by {result.max_difference:.3g} in the logits (tolerance {result.tolerance:.3g}), so its results would be wrong; "
            f"refusing (pass --skip-self-check / self_check=False only if you know why)")
    return result


__all__ = ["Exactness", "measure_exactness", "prefill_and_decode", "probe_length", "self_check"]
