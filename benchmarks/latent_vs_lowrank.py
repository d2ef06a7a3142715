"""Cross-head ``latent`` against per-head ``lowrank`` at equal bytes per token: bytes, KL against none, accuracy.

    PYTHONPATH=. flock /tmp/kveval-heavy.lock python3 benchmarks/latent_vs_lowrank.py [--model smollm2-135m]
        [--family niah_single --family niah_multikey] [--length 512] [--n 10] [--ranks 16,32]

For each per-head rank ``r`` of ``--ranks`` the model's KV heads ``H`` give one
byte budget: ``lowrank(rank=r)`` stores ``2 r`` numbers per head and layer, so
``latent(rank=H*r)`` (one latent for all heads) stores as many, and so does
``latent(rank=H*r - H*d/2, rope_dims=d)`` (``d`` RoPE dimensions per head at
full rank, ``--rope-dims``, default 8). Every policy runs on the same probe
items with the baseline's answers teacher-forced through it
(:mod:`kveval.runner.fidelity`), and the table gives, per policy: measured bytes per
token, the mean and 95% interval of the per-item mean KL against ``none``,
top-1 agreement, accuracy and the items that flipped against the baseline. On a
model with one KV head (Gemma-3-270M) ``latent`` at ``group=1`` is per-head low
rank, so only the RoPE variant differs there. It loads an embedded model: run
it under the heavy lock.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from _common import specs_of


def budget_policies(kv_heads: int, ranks: list[int], rope_dims: int) -> list[list[str]]:
    """Per budget, the policies of equal bytes per token: per-head low rank, cross-head latent, latent with RoPE dims."""
    groups = []
    for r in ranks:
        row = [f"lowrank(rank={r})", f"latent(rank={kv_heads * r})"]
        if rope_dims and kv_heads * r - kv_heads * rope_dims // 2 >= 1:
            row.append(f"latent(rank={kv_heads * r - kv_heads * rope_dims // 2},rope_dims={rope_dims})")
        groups.append(row)
    return groups


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--family", action="append", default=None, help="probe family; repeat (default niah_single, niah_multikey)")
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--n", type=int, default=10, help="items per family")
    parser.add_argument("--ranks", default="16,32", help="per-head lowrank ranks, one byte budget each")
    parser.add_argument("--rope-dims", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--out", default=None, help="run folder root (default: a temporary folder)")
    args = parser.parse_args()

    from kveval.planner.model_specs import load_model_spec
    from kveval.probes import generate_items
    from kveval.runner.evaluate import evaluate_policies
    from kveval.runner.models import load_model
    from kveval.runs.fidelity import read_fidelity
    from kveval.runs.records import read_items, read_run_info
    from kveval.stats.fidelity import kl_bounds

    families = args.family or ["niah_single", "niah_multikey"]
    model, tokenizer = load_model(args.model)
    kv_heads = load_model_spec(model.config).kv_heads
    budgets = budget_policies(kv_heads, [int(r) for r in args.ranks.split(",")], args.rope_dims)
    policies = ["none"] + [p for row in budgets for p in row]
    items = [it for fam in families for it in generate_items(fam, tokenizer, args.length, args.n)]
    out = Path(args.out or tempfile.mkdtemp(prefix="kveval-latent-"))
    started = time.perf_counter()
    dirs = evaluate_policies(model, tokenizer, items, specs_of(policies), out, args.model, batch_size=args.batch_size, fidelity=True)
    seconds = time.perf_counter() - started
    ids = [it.id for it in items]
    right = {p: {r.id: bool(r.correct) for r in read_items(d)} for p, d in zip(policies, dirs)}
    info = {p: read_run_info(d) for p, d in zip(policies, dirs)}
    print(f"{args.model} ({kv_heads} KV heads), {len(items)} items ({', '.join(families)}, {args.length} tokens), "
          f"{seconds:.0f} s; {out}")
    print(f"{'policy':<32} {'bytes/token':>11} {'ratio':>6} {'KL mean (95% CI), nats':>28} {'top-1':>6} {'acc':>5} {'flips -/+':>9}")
    base_bytes = info["none"].bytes_per_token
    for row in [["none"]] + budgets:
        for p in row:
            line = f"{p:<32} {info[p].bytes_per_token:>11.0f} {base_bytes / info[p].bytes_per_token:>6.2f}"
            if p == "none":
                line += f" {'-':>28} {'-':>6}"
            else:
                fid = read_fidelity(dirs[policies.index(p)])
                kl = [fid[i].kl_mean for i in ids]
                low, high = kl_bounds(kl)
                line += (f" {statistics.fmean(kl):>10.4f} ({low:.4f}, {high:.4f})"
                         f" {statistics.fmean(fid[i].top1_agreement for i in ids) * 100:>5.1f}%")
            lost = sum(right["none"][i] and not right[p][i] for i in ids)
            gained = sum(right[p][i] and not right["none"][i] for i in ids)
            line += f" {statistics.fmean(right[p][i] for i in ids):>5.2f} {lost:>4}/{gained:<4}"
            print(line)
        print()


if __name__ == "__main__":
    main()
