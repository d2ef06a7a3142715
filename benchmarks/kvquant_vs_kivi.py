"""kvquant against KIVI at 2 and 4 bits, at equal bytes per token: bytes/token, accuracy and mean KL side by side.

    flock /tmp/kveval-heavy.lock python3 benchmarks/kvquant_vs_kivi.py [--model smollm2-135m]
        [--family passkey] [--length 512] [--n 20] [--residual 32]

Equal bytes: per encoded token and KV head (head_dim D, 16-bit cache), KIVI at
``b`` bits with group 32 holds ``2 * D * b / 8`` code bytes plus 16 bytes of
scales and zero points (keys: a float16 pair per channel per 32 tokens = 8 bytes
a token at D = 64; values: a pair per 32 channels); kvquant holds the same code
bytes, 4 bytes of value range, and 3 bytes per sparse outlier (bf16 value +
uint8 index) in K and in V. So kvquant gets ``outliers`` such that
``2 * 3 * k + 4 = 16`` (k = 2 outliers a vector at D = 64): equal per-token
bytes. KIVI keeps ``--residual`` recent tokens in full precision plus the 0-31
tokens of its unfilled key group (16 on average); kvquant keeps ``--residual + 16``
(and its one sink token). The table prints the bytes per token each run really measured.

Accuracy and KL come from ``kveval eval --fidelity`` semantics (the baseline's
own answer teacher-forced through each policy; :mod:`kveval.runner.fidelity`). It
loads an embedded model: run it under the heavy lock.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from _common import specs_of


def equal_bytes_outliers(head_dim: int, bits: int, kv_itemsize: int = 2, group: int = 32) -> float:
    """The ``outliers`` fraction that gives kvquant KIVI's per-token bytes (both ``bits``, KIVI's ``group``)."""
    from kveval.stores.kvquant import index_dtype

    kivi_extra = 2 * 2 * head_dim / group + 2 * 2 * head_dim / group  # K scale+zero per channel-group, V per token-group
    per_outlier = 2 * (kv_itemsize + index_dtype(head_dim).itemsize)  # one in K and one in V
    k = max(0, round((kivi_extra - 4) / per_outlier))
    return k / head_dim


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--family", action="append", default=None, help="probe family; repeat (default passkey)")
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--n", type=int, default=20, help="items per family")
    parser.add_argument("--residual", type=int, default=32, help="full-precision recent tokens, both methods")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--out", default=None, help="run folder root (default: a temporary folder)")
    args = parser.parse_args()

    from kveval.modeling.architectures import cache_head_dims
    from kveval.probes import generate_items
    from kveval.runner.evaluate import evaluate_policies
    from kveval.runner.models import load_model
    from kveval.runs.fidelity import read_fidelity
    from kveval.runs.records import read_items, read_run_info

    model, tokenizer = load_model(args.model)
    head_dim = cache_head_dims(model.config)[0]
    families = args.family or ["passkey"]
    items = [it for fam in families for it in generate_items(fam, tokenizer, args.length, args.n)]
    pairs = []
    for bits in (2, 4):
        outliers = equal_bytes_outliers(head_dim, bits)
        pairs.append((f"kivi(bits={bits},group=32,residual={args.residual})",
                      f"kvquant(bits={bits},outliers={outliers:g},residual={args.residual + 32 // 2})"))
    policies = ["none"] + [p for pair in pairs for p in pair]
    out = Path(args.out or tempfile.mkdtemp(prefix="kveval-kvquant-"))
    started = time.perf_counter()
    runs = evaluate_policies(model, tokenizer, items, specs_of(policies), out, args.model, batch_size=args.batch_size, fidelity=True)
    seconds = time.perf_counter() - started
    ids = [it.id for it in items]
    print(f"{args.model} (head_dim {head_dim}), {len(items)} items ({', '.join(families)}, {args.length} tokens), "
          f"{seconds:.0f} s; {out}")
    print(f"  {'policy':<44} {'bytes/token':>11} {'accuracy':>9} {'mean KL':>9} {'top-1':>7} {'answer logp':>12}")
    for name, run in zip(policies, runs):
        info = read_run_info(run)
        right = {r.id: float(r.correct) for r in read_items(run)}
        line = f"  {name:<44} {info.bytes_per_token or 0:>11.1f} {statistics.fmean(right[i] for i in ids):>9.3f}"
        if name != "none":
            f = read_fidelity(run)
            line += (f" {statistics.fmean(f[i].kl_mean for i in ids):>9.4f} "
                     f"{statistics.fmean(f[i].top1_agreement for i in ids) * 100:>6.1f}% "
                     f"{statistics.fmean(f[i].answer_logprob_delta for i in ids):>+12.3f}")
        print(line)
    print("  ratios kvquant / KIVI at equal bits (bytes per token, mean KL):")
    by_name = dict(zip(policies, runs))
    for kivi, kvq in pairs:
        b_kivi, b_kvq = (read_run_info(by_name[n]).bytes_per_token or 0 for n in (kivi, kvq))
        kl_kivi, kl_kvq = (statistics.fmean(read_fidelity(by_name[n])[i].kl_mean for i in ids) for n in (kivi, kvq))
        print(f"    {kvq.split(',')[0]}): bytes {b_kvq / b_kivi:.3f}x, KL {kl_kvq / kl_kivi if kl_kivi else float('nan'):.3f}x")


if __name__ == "__main__":
    main()
