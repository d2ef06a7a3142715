"""Print the "Supported architectures" table of docs/architectures.md from the test matrix's tiny models.

Per architecture (tests/tiny_models.py ARCHITECTURES, the models tests/test_architectures.py checks):
its cache layers, the attention kernel kveval uses, the largest logit difference
between policy ``none`` and the model's own eager attention (the load-time
self-check probe: 24-token prefill + 4 decode steps, stored tokens in the
compute dtype), and measured K/V bytes per token after a 256-token prefill
under ``none``, ``kivi(bits=4)`` and ``snapkv(ratio=0.5)`` with the cache in
bfloat16 (the deployment default), plus the constant per-sequence state bytes
of linear-attention / Mamba layers. For MLA models it also prints latent bytes
per token against the per-head K/V bytes older transformers materialised.

    python scripts/architecture_table.py [--device cuda --dtype bfloat16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from kveval.cache.compressed import CompressedCache  # noqa: E402
from kveval.cache.exactness import measure_exactness  # noqa: E402
from kveval.modeling import architectures  # noqa: E402
from kveval.policies.spec import parse_policy

from tiny_models import ARCHITECTURES, tiny_model  # noqa: E402

POLICIES = ("none", "kivi(bits=4)", "snapkv(ratio=0.5)")
TOKENS = 256


def layer_summary(config) -> str:
    """E.g. ``1 sliding(16) + 1 full``; ``3 linear + 1 full``."""
    counts: dict[str, int] = {}
    for plan in architectures.cache_layer_plan(config):
        if plan.kind == architectures.STATE:
            label = "state"
        elif plan.kind == architectures.HYBRID:
            label = "state+attention"
        elif plan.kind == architectures.NONE:
            label = "none"
        else:
            kind = "chunked" if plan.chunked else "sliding"
            label = f"{kind}({plan.sliding_window})" if plan.sliding_window else "full"
        counts[label] = counts.get(label, 0) + 1
    text = " + ".join(f"{n} {label}" for label, n in counts.items())
    return text + (" MLA" if architectures.mla_dims(config) else "")


class KernelRecorder:
    """Records which eager variants kveval's attention function chose while it is installed."""

    def __init__(self):
        self.variants: set[str] = set()
        self._original = architectures.eager_variant

    def __enter__(self):
        def recording(module, kwargs):
            variant = self._original(module, kwargs)
            if variant:
                self.variants.add(variant)
            return variant

        architectures.eager_variant = recording
        return self

    def __exit__(self, *exc):
        architectures.eager_variant = self._original

    @property
    def name(self) -> str:
        """``sdpa``, or ``eager (<variant>)`` for the variants SDPA cannot express."""
        return f"eager ({', '.join(sorted(self.variants))})" if self.variants else "sdpa"


def bytes_per_token(model, spec: str, ids: torch.Tensor) -> tuple[float, int]:
    cache = CompressedCache(model, parse_policy(spec), kv_dtype=torch.bfloat16)
    with torch.no_grad():
        model(ids, cache=cache)
    stats = cache.stats()
    return stats.bytes_per_token, stats.state_bytes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    dtype = getattr(torch, args.dtype)
    ids = torch.randint(3, 128, (1, TOKENS), generator=torch.Generator().manual_seed(0)).to(args.device)
    print(f"| architecture | cache layers | attention | max logit diff, `none` vs eager ({args.dtype}) | "
          + " | ".join(f"B/token `{p}`" for p in POLICIES) + " | state B/sequence |")
    print("|---|---|---|---|" + "---|" * len(POLICIES) + "---|")
    mla_lines = []
    for name in ARCHITECTURES:
        model = tiny_model(name).to(args.device, dtype)
        with KernelRecorder() as kernels:
            exactness = measure_exactness(model)
        measured = [bytes_per_token(model, spec, ids) for spec in POLICIES]
        print(f"| {name} | {layer_summary(model.config)} | {kernels.name} | {exactness.max_difference:.1e} | "
              + " | ".join(f"{b:,.0f}" for b, _ in measured) + f" | {measured[0][1]:,} |")
        dims = architectures.mla_dims(model.config)
        if dims is not None:
            layers = sum(p.holds_tokens for p in architectures.cache_layer_plan(model.config))
            mla_lines.append(f"{name}: latent cache {dims.latent_elements * layers * 2:,} B/token in bfloat16 "
                             f"((kv_lora_rank {dims.kv_lora_rank} + qk_rope_head_dim {dims.qk_rope_head_dim}) x {layers} layers x 2 B) "
                             f"vs per-head K/V {dims.per_head_elements * layers * 2:,} B/token ({dims.heads} heads x "
                             f"(nope {dims.qk_nope_head_dim} + rope {dims.qk_rope_head_dim} + v {dims.v_head_dim}) x {layers} layers x 2 B): "
                             f"{dims.per_head_elements / dims.latent_elements:.1f}x smaller")
    print(f"\nTiny random configs (tests/tiny_models.py), {TOKENS}-token prefill, cache in bfloat16; model in {args.dtype} on {args.device}.")
    for line in mla_lines:
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
