"""Head-adaptive budgets at equal measured bytes: AdaKV-SnapKV vs SnapKV, retrieval heads (duo) vs StreamingLLM.

    flock /tmp/kveval-heavy.lock python3 benchmarks/adakv.py [--model smollm2-135m]
        [--family niah_multikey] [--length 512] [--n 20] [--ratios 0.5,0.8] [--duo "duo(heads=0.25,sink=4,window=64)"]

AdaKV moves a layer's budget between KV heads without changing its total, so
``snapkv(ratio=r,adaptive=true)`` holds exactly the bytes of ``snapkv(ratio=r)``
(checked: the table prints both). ``duo`` keeps every token in its retrieval
heads, so its bytes grow with the context; its StreamingLLM rival gets the
window that holds the same tokens on average: per KV head,
``f x n + (1 - f) x (sink + window)`` with ``f`` the share of heads ``duo``
keeps whole on this model and ``n`` the mean prompt length.

For each policy: measured K/V bytes per token, accuracy, and the fidelity
signal (:mod:`kveval.runner.fidelity`: the baseline's own answer teacher-forced, mean
per-token KL in nats, top-1 agreement). It loads an embedded model: run it
under the heavy lock.
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import add_probe_options, families, load_model_and_items, run_root, specs_of


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_probe_options(parser, n=20)
    parser.add_argument("--ratios", default="0.5,0.8")
    parser.add_argument("--duo", default="duo(heads=0.25,sink=4,window=64)")
    args = parser.parse_args()

    from kveval.policies.spec import parse_policy
    from kveval.runner.evaluate import evaluate_policies
    from kveval.runs.fidelity import read_fidelity
    from kveval.runs.records import read_items

    model, tokenizer, items = load_model_and_items(args)
    duo = parse_policy(args.duo).selection
    fraction = duo.retrieval_fraction(model)
    mean_length = statistics.fmean(it.length for it in items)
    per_head = fraction * mean_length + (1 - fraction) * (duo.sink + duo.recent)
    streaming = f"streaming(sink={duo.sink},window={round(per_head) - duo.sink})"
    policies = ["none"]
    for ratio in (float(r) for r in args.ratios.split(",")):
        policies += [f"snapkv(ratio={ratio:g})", f"snapkv(ratio={ratio:g},adaptive=true)"]
    policies += [parse_policy(args.duo).spec, streaming]

    out = run_root(args, "kveval-adakv-")
    started = time.perf_counter()
    dirs = evaluate_policies(model, tokenizer, items, specs_of(policies), out, args.model, batch_size=args.batch_size, fidelity=True)
    seconds = time.perf_counter() - started
    print(f"{args.model}, {len(items)} {', '.join(families(args))} items (~{mean_length:.0f} tokens), {seconds:.0f} s; {out}")
    print(f"duo keeps {fraction:.3f} of KV heads whole (retrieval heads by passkey attention mass, a stand-in for "
          f"DuoAttention's gates); its equal-bytes StreamingLLM is {streaming}")
    print(f"{'policy':<42} {'B/token':>9} {'accuracy':>9} {'KL mean':>9} {'top-1':>7}")
    for spec, folder in zip(policies, dirs):
        records = read_items(folder)
        per_token = statistics.fmean(r.metrics["bytes_per_token"] for r in records)
        accuracy = statistics.fmean(float(r.correct) for r in records)
        line = f"{spec:<42} {per_token:>9.0f} {accuracy:>9.3f}"
        if spec != "none":
            fid = list(read_fidelity(folder).values())
            line += (f" {statistics.fmean(f.kl_mean for f in fid):>9.4f}"
                     f" {statistics.fmean(f.top1_agreement for f in fid) * 100:>6.1f}%")
        print(line)


if __name__ == "__main__":
    main()
