"""Does a deterministic mode remove the batch-arrangement flips of greedy answers, and what does it cost?

The gate's noise floor (``kveval sweep --noise-floor``) is the baseline against itself in another batch arrangement.
This script measures it twice, side by side in one run: with torch's default kernels and with
``torch.use_deterministic_algorithms(True)``. Each measurement runs the uncompressed baseline on the same items at
``--batch-size`` in order and at half of it in reverse order, and counts the items whose answer and whose
correctness differ; it prints the flips and the time ratio of the deterministic mode to the default one.

    python3 benchmarks/noise_floor.py --n 10 --length 384 --batch-size 8

Deterministic algorithms fix the reduction order *within* a kernel call for a given shape. A batch of another
size is another shape, so they are not expected to remove these flips; this script checks that instead of
assuming it.
"""

from __future__ import annotations

import argparse
import time

from _common import add_probe_options, load_model_and_items, run_root, specs_of


def _answers(model, tokenizer, items, batch_size: int, root, name: str) -> dict:
    from kveval.runner.evaluate import evaluate_policies
    from kveval.runs.records import read_items

    [run_dir] = evaluate_policies(model, tokenizer, items, specs_of(["none"]), root / name, "bench", batch_size)
    return {r.id: (r.answer, r.correct) for r in read_items(run_dir)}


def measure(model, tokenizer, items, batch_size: int, root, label: str) -> tuple[int, int, float]:
    """(answers that differ, correctness flips, seconds) between the two batch arrangements."""
    started = time.perf_counter()
    first = _answers(model, tokenizer, items, batch_size, root, f"{label}-b{batch_size}")
    second = _answers(model, tokenizer, list(reversed(items)), max(1, batch_size // 2), root, f"{label}-rev")
    seconds = time.perf_counter() - started
    answers = sum(first[i][0] != second[i][0] for i in first)
    flips = sum(first[i][1] != second[i][1] for i in first)
    return answers, flips, seconds


def main() -> None:
    import torch

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_probe_options(parser, n=10, families=("passkey", "niah_multikey"), length=384)
    args = parser.parse_args()
    model, tokenizer, items = load_model_and_items(args)
    root = run_root(args, "kveval-noise-floor-")
    default = measure(model, tokenizer, items, args.batch_size, root, "default")
    torch.use_deterministic_algorithms(True)
    try:
        deterministic = measure(model, tokenizer, items, args.batch_size, root, "deterministic")
    finally:
        torch.use_deterministic_algorithms(False)
    print(f"{len(items)} items, batch {args.batch_size} in order against batch {max(1, args.batch_size // 2)} reversed")
    print(f"{'mode':<14} {'answers differ':>15} {'flips':>6} {'seconds':>8}")
    for name, (answers, flips, seconds) in (("default", default), ("deterministic", deterministic)):
        print(f"{name:<14} {answers:>15} {flips:>6} {seconds:>8.1f}")
    print(f"deterministic / default time: {deterministic[2] / default[2]:.2f}x")


if __name__ == "__main__":
    main()
