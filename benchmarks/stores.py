"""Decode-step cost of the token stores, side by side: eviction that gathers stored units against keeping everything.

    python3 benchmarks/stores.py [--heads 3] [--head-dim 64] [--context 1024] [--steps 128] [--budget 768]

No model: one layer's store for one sequence, fed random bf16 K/V one token a
step, as the cache does while decoding (append, seal, read back for attention).
With a budget, one token per head (a different one in each head, as H2O or TOVA
choose) is evicted every step once the budget is reached. Prints, per store,
the time per step relative to a dense store without eviction, and the bytes held
at the end relative to a dense bf16 store of the same kept tokens (evicted slots
that per-channel groups still hold show up there).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kveval.policies.spec import parse_policy
from kveval.stores.base import DenseStore
from kveval.stores.quantized import QuantizedStore

SPECS = ["none", "quant(bits=8)", "quant(bits=4,group=32)", "kivi(bits=4)", "kivi(bits=2)", "fp8"]


def make(spec: str):
    quant = parse_policy(spec).quantization
    if quant is None:
        return DenseStore(torch.bfloat16, torch.float32)
    return QuantizedStore(quant.key_quant, quant.value_quant, quant.residual_tokens, torch.bfloat16, torch.float32)


def run(spec: str, args, budget: int | None, seed: int) -> tuple[float, float]:
    """Seconds per decode step and bytes held / dense bf16 bytes of the kept tokens."""
    g = torch.Generator().manual_seed(seed)
    store = make(spec)
    x = torch.randn(args.heads, args.context, args.head_dim, generator=g)
    store.append(x, x)
    store.seal()
    started = time.perf_counter()
    for _ in range(args.steps):
        token = torch.randn(args.heads, 1, args.head_dim, generator=g)
        store.append(token, token)
        store.seal()
        if budget is not None and store.length > budget:
            n = store.length
            drop = torch.randint(0, n - 1, (args.heads,), generator=g)  # the newest token is always kept
            keep = torch.arange(n).expand(args.heads, -1)
            index = keep[keep != drop[:, None]].reshape(args.heads, n - 1)
            store.select(index)
            store.seal()
        store.keys_values()
    seconds = (time.perf_counter() - started) / args.steps
    dense = 2 * args.heads * store.length * args.head_dim * 2
    return seconds, store.nbytes / dense


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=128)
    parser.add_argument("--budget", type=int, default=768, help="decode budget: evict one token per head per step past it")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)

    rows = {}
    for spec in SPECS:
        for budget in (None, args.budget):
            times, ratio = [], 0.0
            for r in range(args.repeats):
                seconds, ratio = run(spec, args, budget, seed=r)
                times.append(seconds)
            rows[(spec, budget)] = (statistics.median(times), ratio)
    base = rows[("none", None)][0]
    print(f"{args.heads} KV heads, head_dim {args.head_dim}, {args.context}-token context, {args.steps} decode steps, "
          f"median of {args.repeats}; time relative to a dense store without eviction ({base * 1e3:.2f} ms/step)")
    print(f"{'store':<24} {'time, keep all':>15} {'time, evicting':>15} {'bytes, keep all':>16} {'bytes, evicting':>16}")
    for spec in SPECS:
        (t_all, b_all), (t_evict, b_evict) = rows[(spec, None)], rows[(spec, args.budget)]
        print(f"{spec:<24} {t_all / base:>15.2f} {t_evict / base:>15.2f} {b_all:>16.3f} {b_evict:>16.3f}")


if __name__ == "__main__":
    main()
