"""Wall-time and byte ratios of every policy against uncompressed generation, side by side in one run.

    python3 benchmarks/policies.py [--model smollm2-135m] [--length 768] [--n 4] [--new-tokens 16] [--kv-dtype bfloat16]

Prints, per policy, generation time / uncompressed generation time on the same
prompts (run interleaved, median of --repeats, so machine noise hits all alike),
measured / uncompressed cache bytes (uncompressed: the deployment's cache
dtype, ``--kv-dtype``, default the checkpoint's), and the saving of one prefill
for many ratios (kveval.runner.generation.generate_many) against one prefill per ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

from kveval.policies.spec import parse_policy

POLICIES = [
    "quant(bits=8)", "quant(bits=4,group=32)", "kivi(bits=4)", "kivi(bits=2)", "fp8", "streaming(sink=4,window=252)",
    "h2o(ratio=0.5)", "snapkv(ratio=0.5)", "pyramidkv(ratio=0.5)", "tova(ratio=0.5)", "knorm(ratio=0.5)", "random(ratio=0.5)",
    "snapkv(ratio=0.5)+kivi(bits=4)", "h2o(ratio=0.5,decode_budget=300)+kivi(bits=4)",
]
RATIOS = [0.25, 0.5, 0.75, 0.9]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=768)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--policy", action="append", help="policies to time (default: a representative set)")
    parser.add_argument("--kv-dtype", default=None, help="cache dtype bytes are stated against (default: the checkpoint's)")
    args = parser.parse_args()

    from kveval.probes import encode_item, generate_items
    from kveval.runner.generation import Prompt, generate, generate_many
    from kveval.runner.models import load_model
    from kveval.dtypes import deployment_kv_dtype, dtype_name, parse_kv_dtype

    model, tokenizer = load_model(args.model)
    items = generate_items("niah_multikey", tokenizer, args.length, args.n)
    prompts = [Prompt(*encode_item(tokenizer, item)) for item in items]
    policies = ["none"] + (args.policy or POLICIES)
    kv_dtype = parse_kv_dtype(args.kv_dtype) if args.kv_dtype else deployment_kv_dtype(model)

    def timed(fn):
        start = time.perf_counter()
        out = fn()
        return time.perf_counter() - start, out

    generate(model, tokenizer, prompts[:1], parse_policy("none"), max_new_tokens=2)  # warm-up
    times = {p: [] for p in policies}
    ratios = {}
    for _ in range(args.repeats):
        for policy in policies:  # interleaved: every policy sees the same machine state
            seconds, results = timed(lambda: generate(model, tokenizer, prompts, parse_policy(policy), max_new_tokens=args.new_tokens,
                                                      kv_dtype=kv_dtype))
            times[policy].append(seconds)
            ratios[policy] = sum(r.stats.kv_bytes for r in results) / sum(r.stats.nominal_bytes for r in results)
    base = statistics.median(times["none"])
    print(f"model {args.model}, {len(prompts)} prompts of ~{args.length} tokens, {args.new_tokens} new tokens, "
          f"median of {args.repeats}, bytes against a {dtype_name(kv_dtype)} cache")
    print(f"{'policy':<58} {'time ratio':>10} {'bytes ratio':>12}")
    for policy in policies:
        print(f"{policy:<58} {statistics.median(times[policy]) / base:>10.2f} {ratios[policy]:>12.3f}")

    specs = [f"snapkv(ratio={r})" for r in RATIOS]
    separate, shared = [], []
    for _ in range(args.repeats):
        separate.append(timed(lambda: [generate(model, tokenizer, prompts, parse_policy(s), max_new_tokens=args.new_tokens) for s in specs])[0])
        shared.append(timed(lambda: generate_many(model, tokenizer, prompts, [parse_policy(p) for p in specs], max_new_tokens=args.new_tokens))[0])
    print(f"\none prefill for {len(RATIOS)} snapkv ratios: {statistics.median(shared):.1f} s vs one prefill each "
          f"{statistics.median(separate):.1f} s (time ratio {statistics.median(shared) / statistics.median(separate):.2f})")


if __name__ == "__main__":
    main()
