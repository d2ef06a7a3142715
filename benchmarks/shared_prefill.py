"""One shared prefill for a sweep's policies against one prefill per policy, on the same items in one run.

    python3 benchmarks/shared_prefill.py [--config configs/quickstart.yaml] [--model smollm2-135m]
                                         [--length 384 --length 2048] [--n 1] [--family passkey] [--repeats 1]

Takes the policy set (plus the baseline ``none``), probe families, mode and
batch size of a sweep config (default: the quickstart's), builds ``--n`` items
per family at each ``--length``, and times, per length:

- *per-policy*: one :func:`kveval.generation.generate` per policy, each with its own prefill (kveval before issue 16);
- *shared*: :func:`kveval.generation.generate_many`, one prefill per batch for all policies.

Per item it prints prefill seconds (everything before the first generated
token: the prefill(s), deriving each policy's cache, the question) and decode
seconds (greedy decoding, all policies), separately, and the ratio of the
totals. The answers of both paths are checked to be identical, token for token.
Run alone on the machine (``flock /tmp/kveval-heavy.lock``): it is a timing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _decode_seconds(results_by_policy: dict, batch_size: int) -> float:
    """Decode time of every batch of every policy (each row of a batch reports its batch's)."""
    return sum(r.decode_seconds for results in results_by_policy.values() for r in results[::batch_size])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "quickstart.yaml"))
    parser.add_argument("--model", default=None, help="default: the config's first model")
    parser.add_argument("--length", action="append", type=int, default=None, help="prompt tokens; repeat (default 384, 2048)")
    parser.add_argument("--n", type=int, default=1, help="items per family and length")
    parser.add_argument("--family", action="append", default=None, help="probe family; repeat (default: the config's)")
    parser.add_argument("--repeats", type=int, default=1, help="timings per path (median; paths interleaved)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default: each probe's own answer length")
    args = parser.parse_args()

    from kveval.generation import Prompt, generate, generate_many
    from kveval.models import load_model
    from kveval.probes import encode_item, generate_items
    from kveval.sweep import load_config

    config = load_config(args.config)
    model_name = args.model or config.models[0]
    specs = ["none"] + [s.spec for s in config.policies]
    mode, batch_size, families = config.mode, config.batch_size, args.family or config.families
    model, tokenizer = load_model(model_name)
    generate(model, tokenizer, [Prompt(tokenizer("warm up")["input_ids"])], "none", max_new_tokens=2)

    rows = []
    for length in args.length or [384, 2048]:
        items = [it for family in families for it in generate_items(family, tokenizer, length, args.n, seed=config.seed)]
        prompts = [Prompt(*encode_item(tokenizer, it)) for it in items]
        new_tokens = args.new_tokens or max(it.max_new_tokens for it in items)
        kwargs = dict(max_new_tokens=new_tokens, mode=mode, batch_size=batch_size, kv_dtype=config.kv_dtype)
        timings = {"per-policy": [], "shared": []}
        for _ in range(args.repeats):
            start = time.perf_counter()
            separate = {s: generate(model, tokenizer, prompts, s, **kwargs) for s in specs}
            wall = time.perf_counter() - start
            timings["per-policy"].append((wall, _decode_seconds(separate, batch_size)))
            start = time.perf_counter()
            shared = generate_many(model, tokenizer, prompts, specs, **kwargs)
            wall = time.perf_counter() - start
            timings["shared"].append((wall, _decode_seconds(shared, batch_size)))
            for s in specs:
                if [r.token_ids for r in separate[s]] != [r.token_ids for r in shared[s]]:
                    raise SystemExit(f"{s}: the shared prefill changed an answer at {length} tokens; this is a bug")
        mean_tokens = statistics.fmean(p.length for p in prompts)
        out = {}
        for path, runs in timings.items():
            wall = statistics.median(w for w, _ in runs)
            decode = statistics.median(d for _, d in runs)
            out[path] = (wall - decode, decode, wall)
        rows.append((length, mean_tokens, len(prompts), out))

    print(f"model {model_name}, {len(specs)} policies ({', '.join(specs)}), mode {mode}, batch size {batch_size}, "
          f"{args.n} item(s) per family of {', '.join(families)}; seconds per item, all policies together, "
          f"median of {args.repeats}")
    print(f"{'length':>7} {'items':>5} | {'per-policy: prefill':>19} {'decode':>7} {'total':>7} | "
          f"{'shared: prefill':>15} {'decode':>7} {'total':>7} | {'speed-up':>8}")
    for length, mean_tokens, n, out in rows:
        (pp, pd, pt), (sp, sd, st) = out["per-policy"], out["shared"]
        print(f"{mean_tokens:>7.0f} {n:>5} | {pp / n:>19.2f} {pd / n:>7.2f} {pt / n:>7.2f} | "
              f"{sp / n:>15.2f} {sd / n:>7.2f} {st / n:>7.2f} | {pt / st:>7.2f}x")


if __name__ == "__main__":
    main()
