"""One shared prefill for a sweep's policies against one prefill per policy, on the same items in one run.

    python3 benchmarks/shared_prefill.py [--config configs/quickstart.yaml] [--model smollm2-135m]
                                         [--length 384 --length 2048 --length 8192@gemma3-270m] [--n 1]
                                         [--family passkey] [--repeats 1]

Takes the policy set (plus the baseline ``none``), probe families, mode and
batch size of a sweep config (default: the quickstart's), builds ``--n`` items
per family at each ``--length`` (``LENGTH@MODEL`` for another model than
``--model``: SmolLM2 stops at 8192 positions, so the default 8k row runs on
Gemma-3-270M), and times, per length:

- *per-policy*: one :func:`kveval.runner.generation.generate` per policy, each with its own prefill (kveval before issue 16);
- *shared*: :func:`kveval.runner.generation.generate_many`, one prefill per batch for all policies.

Per item it prints prefill seconds (everything before the first generated
token: the prefill(s), deriving each policy's cache, the question) and decode
seconds (greedy decoding, all policies), separately, and the ratio of the
totals. The answers of both paths are checked to be identical, token for token.

It also checks the issue-16 target "k policies cost at most 1 prefill + k x
(question + decode)": *1 prefill* is one plain uncompressed prefill of the
contexts (timed on its own), and each policy's *question + decode* is its
per-policy run less that prefill (its compression, its question, its decoding).
The shared path's wall time is compared with that bound.
Run alone on the machine (``flock /tmp/kveval-heavy.lock``): it is a timing.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from kveval.policies.spec import parse_policy

ROOT = Path(__file__).resolve().parent.parent


def _decode_seconds(results_by_policy: dict, batch_size: int) -> float:
    """Decode time of every batch of every policy (each row of a batch reports its batch's)."""
    return sum(r.decode_seconds for results in results_by_policy.values() for r in results[::batch_size])


def _plain_prefill_seconds(model, tokenizer, prompts: list, mode: str, batch_size: int, kv_dtype) -> float:
    """One uncompressed prefill of every batch's prompts (the *1 prefill* of the bound), seconds."""
    import torch

    from kveval.cache.compressed import CompressedCache
    from kveval.runner.generation import prefill_prompts

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    seconds = 0.0
    with torch.no_grad():
        for first in range(0, len(prompts), batch_size):
            cache = CompressedCache(model, parse_policy("none"), kv_dtype=kv_dtype)
            start = time.perf_counter()
            prefill_prompts(model, cache, prompts[first:first + batch_size], mode, pad_id)
            seconds += time.perf_counter() - start
            del cache
    return seconds


def _rows(lengths: list[str], default_model: str) -> dict[str, list[int]]:
    """``["384", "8192@gemma3-270m"]`` -> ``{model: [lengths]}`` in order of first appearance."""
    by_model: dict[str, list[int]] = {}
    for text in lengths:
        length, _, model = text.partition("@")
        by_model.setdefault(model or default_model, []).append(int(length))
    return by_model


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(ROOT / "configs" / "quickstart.yaml"))
    parser.add_argument("--model", default=None, help="default: the config's first model")
    parser.add_argument("--length", action="append", default=None,
                        help="prompt tokens, optionally @MODEL; repeat (default 384, 2048, 8192@gemma3-270m)")
    parser.add_argument("--n", type=int, default=1, help="items per family and length")
    parser.add_argument("--family", action="append", default=None, help="probe family; repeat (default: the config's)")
    parser.add_argument("--repeats", type=int, default=1, help="timings per path (median; paths interleaved)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default: each probe's own answer length")
    args = parser.parse_args()

    from kveval.probes import encode_item, generate_items
    from kveval.runner.generation import Prompt, generate, generate_many
    from kveval.runner.models import load_model
    from kveval.sweep.config import load_config

    config = load_config(args.config)
    default_model = args.model or config.models[0]
    specs = ["none"] + [s.spec for s in config.policies]
    mode, batch_size, families = config.mode, config.batch_size, args.family or config.families

    rows = []
    for model_name, lengths in _rows(args.length or ["384", "2048", "8192@gemma3-270m"], default_model).items():
        model, tokenizer = load_model(model_name)
        generate(model, tokenizer, [Prompt(tokenizer("warm up")["input_ids"])], parse_policy("none"), max_new_tokens=2)
        for length in lengths:
            items = [it for family in families for it in generate_items(family, tokenizer, length, args.n, seed=config.seed)]
            prompts = [Prompt(*encode_item(tokenizer, it)) for it in items]
            new_tokens = args.new_tokens or max(it.max_new_tokens for it in items)
            kwargs = dict(max_new_tokens=new_tokens, mode=mode, batch_size=batch_size, kv_dtype=config.kv_dtype)
            timings = {"per-policy": [], "shared": []}
            plain = []
            for _ in range(args.repeats):
                plain.append(_plain_prefill_seconds(model, tokenizer, prompts, mode, batch_size, config.kv_dtype))
                start = time.perf_counter()
                separate = {s: generate(model, tokenizer, prompts, parse_policy(s), **kwargs) for s in specs}
                wall = time.perf_counter() - start
                timings["per-policy"].append((wall, _decode_seconds(separate, batch_size)))
                start = time.perf_counter()
                shared = generate_many(model, tokenizer, prompts, [parse_policy(p) for p in specs], **kwargs)
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
            rows.append((model_name, length, mean_tokens, len(prompts), statistics.median(plain), out))
        del model, tokenizer  # the next model loads alone

    print(f"{len(specs)} policies ({', '.join(specs)}), mode {mode}, batch size {batch_size}, "
          f"{args.n} item(s) per family of {', '.join(families)}; seconds per item, all policies together, "
          f"median of {args.repeats}")
    print(f"{'model':>14} {'length':>7} {'items':>5} | {'per-policy: prefill':>19} {'decode':>7} {'total':>7} | "
          f"{'shared: prefill':>15} {'decode':>7} {'total':>7} | {'speed-up':>8}")
    for model_name, length, mean_tokens, n, _, out in rows:
        (pp, pd, pt), (sp, sd, st) = out["per-policy"], out["shared"]
        print(f"{model_name:>14} {mean_tokens:>7.0f} {n:>5} | {pp / n:>19.2f} {pd / n:>7.2f} {pt / n:>7.2f} | "
              f"{sp / n:>15.2f} {sd / n:>7.2f} {st / n:>7.2f} | {pt / st:>7.2f}x")
    k = len(specs)
    print(f"\ncheck: {k} policies cost <= 1 prefill + {k} x (question + decode); seconds per item "
          f"(question + decode of a policy: its per-policy run less one plain prefill)")
    for model_name, length, mean_tokens, n, prefill, out in rows:
        per_policy_total, shared_total = out["per-policy"][2], out["shared"][2]
        bound = prefill + (per_policy_total - k * prefill)
        verdict = "holds" if shared_total <= bound else "does NOT hold"
        print(f"{model_name:>14} {mean_tokens:>7.0f}: 1 prefill {prefill / n:.2f} + {k} x (question + decode) "
              f"{(per_policy_total - k * prefill) / n:.2f} = {bound / n:.2f}; shared {shared_total / n:.2f} "
              f"({shared_total / bound:.2f} of the bound): {verdict}")


if __name__ == "__main__":
    main()
