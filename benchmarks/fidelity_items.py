"""Items per task that accuracy needs to separate two policies, against the items the KL signal needs.

    flock /tmp/kveval-heavy.lock python3 benchmarks/fidelity_items.py [--model smollm2-135m]
        [--family niah_multikey] [--length 512] [--n 30] [--a "kivi(bits=4)"] [--b "kivi(bits=2)"]

Runs the baseline and the two policies on the same ``--n`` probe items with
``kveval eval --fidelity`` semantics (the baseline's own answer teacher-forced
through each policy), then resamples the items with replacement to growing
counts and reports, for each of three pairs (a vs baseline, b vs baseline,
a vs b), the smallest count at which a paired two-sided test gives
p < 0.05 in 80% of resamples (:func:`kveval.stats.fidelity.items_to_separate`):
exact McNemar on right/wrong for accuracy, Wilcoxon signed-rank on the
per-item mean KL (against the baseline: on KL against 0, which the baseline has
by definition) for the fidelity signal. ">1000" means even 1000 items do not.
It loads an embedded model: run it under the heavy lock.
"""

from __future__ import annotations

import argparse
import statistics
import time

from _common import add_probe_options, families, load_model_and_items, run_root, specs_of


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_probe_options(parser, n=30)
    parser.add_argument("--a", default="kivi(bits=4)")
    parser.add_argument("--b", default="kivi(bits=2)")
    args = parser.parse_args()

    from kveval.runner.evaluate import evaluate_policies
    from kveval.runs.fidelity import read_fidelity
    from kveval.runs.records import read_items
    from kveval.stats.fidelity import items_to_separate

    model, tokenizer, items = load_model_and_items(args)
    out = run_root(args, "kveval-fidelity-")
    started = time.perf_counter()
    evaluate_policies(model, tokenizer, items, specs_of(["none", args.a, args.b]), out, args.model, batch_size=args.batch_size)
    middle = time.perf_counter()
    # the same call again: the items are done, only the fidelity passes run
    base, run_a, run_b = evaluate_policies(model, tokenizer, items, specs_of(["none", args.a, args.b]), out, args.model,
                                           batch_size=args.batch_size, fidelity=True)
    seconds, fidelity_seconds = middle - started, time.perf_counter() - middle
    ids = [it.id for it in items]
    right = {name: {r.id: float(r.correct) for r in read_items(d)} for name, d in (("none", base), (args.a, run_a), (args.b, run_b))}
    kl = {args.a: read_fidelity(run_a), args.b: read_fidelity(run_b)}
    print(f"{args.model}, {len(items)} items ({', '.join(families(args))}, {args.length} tokens), "
          f"{seconds:.0f} s for the 3 runs, {fidelity_seconds:.0f} s more for their fidelity; {out}")
    for name in ("none", args.a, args.b):
        line = f"  {name:<22} accuracy {statistics.fmean(right[name][i] for i in ids):.3f}"
        if name in kl:
            f = [kl[name][i] for i in ids]
            line += (f"  KL mean {statistics.fmean(x.kl_mean for x in f):.4f} nats, max {max(x.kl_max for x in f):.3f}, "
                     f"top-1 {statistics.fmean(x.top1_agreement for x in f) * 100:.1f}%, "
                     f"answer logp {statistics.fmean(x.answer_logprob_delta for x in f):+.3f}")
        print(line)
    print("items needed for p < 0.05 in 80% of resamples (accuracy: McNemar; KL: Wilcoxon):")
    zero = [0.0] * len(ids)
    for label, first, second in (("a vs baseline", "none", args.a), ("b vs baseline", "none", args.b), ("a vs b", args.a, args.b)):
        acc = items_to_separate([right[first][i] for i in ids], [right[second][i] for i in ids], "mcnemar")
        kl_first = zero if first == "none" else [kl[first][i].kl_mean for i in ids]
        by_kl = items_to_separate(kl_first, [kl[second][i].kl_mean for i in ids], "wilcoxon")
        print(f"  {label:<14} ({first} vs {second}): accuracy {acc or '>1000'}, KL {by_kl or '>1000'}")


if __name__ == "__main__":
    main()
