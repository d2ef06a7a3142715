"""Print every answer the memory planner gives over the presets, a broad set of policies and lengths, as JSON.

A refactor of the planner or of the policy contract must leave these answers unchanged: run this before and
after and diff the two files (``python3 scripts/planner_answers.py > before.json``). An answer that is a refusal
is recorded as its one-line message, so a refusal that appears or disappears shows in the diff too.
"""

from __future__ import annotations

import dataclasses
import json
import sys

from kveval.planner import engines, memory
from kveval.planner.model_specs import preset_names
from kveval.policies.spec import parse_policy

POLICIES = (
    "none", "quant(bits=8)", "quant(bits=4)", "quant(bits=8,group=16)", "quant(bits=4,group=32,symmetric=true)",
    "quant(k_bits=8,v_bits=4,group=32,symmetric=true)", "quant(bits=4,indexer=fp8)", "kivi(bits=4)",
    "kivi(bits=2)", "kivi(bits=4,group=32,residual=0)", "kivi(bits=4,residual=0,group=4)", "fp8",
    "kvquant(bits=4)", "kvquant(bits=2)", "kvquant(bits=4,pre_rope=false)", "kvquant(bits=4,pre_rope=false,indexer=fp8)",
    "snapkv(ratio=0.5)", "snapkv(ratio=0.5,adaptive=true)", "h2o(ratio=0.5,decode_budget=128)",
    "knorm(ratio=0.5)", "knorm(ratio=0,decode_budget=320,decode_interval=32)", "random(ratio=0.5)",
    "window(size=256)", "streaming(sink=4,window=252)", "tova(ratio=0.75)", "pyramidkv(ratio=0.75)",
    "duo(heads=0.5)", "indexer(ratio=0.5)", "indexer(ratio=0.5)+quant(bits=4,indexer=fp8)",
    "lowrank(rank=32)", "latent(rank=96)", "lowrank(rank=32)+quant(bits=8)", "snapkv(ratio=0.75)+kivi(bits=4)",
    "knorm(ratio=0.5)+fp8", "knorm(ratio=0.5)+kvquant(bits=4,pre_rope=false)", "llamacpp(k=q4_0,v=q4_0)",
    "llamacpp(k=q8_0,v=q4_0)", "vllm(kv_cache_dtype=fp8)", "sglang(kv_cache_dtype=fp8_e4m3)",
    "trtllm(kv_cache_dtype=int8)", "threshold(threshold=0.5)", "keydiff(ratio=0.5)", "chunkkv(ratio=0.5)",
)
CONTEXTS = (1000, 32768, 131072)


def _answer(call):
    try:
        result = call()
    except Exception as e:  # a refusal is an answer too
        return {"error": f"{type(e).__name__}: {e}"}
    return dataclasses.asdict(result) if dataclasses.is_dataclass(result) else result


def main() -> None:
    out = {}
    for spec in POLICIES:
        try:
            stack = parse_policy(spec)
        except Exception as e:
            out[f"parse {spec}"] = {"error": f"{type(e).__name__}: {e}"}
            continue
        for model in preset_names():
            for context in CONTEXTS:
                out[f"plan {model} {spec} {context}"] = _answer(
                    lambda: memory.plan(model, context, 2, parse_policy(spec), 2, new_tokens=64))
            out[f"fit {model} {spec}"] = _answer(lambda: memory.max_fit(model, "80GiB", policy=parse_policy(spec)))
    for model in preset_names():
        out[f"vllm {model}"] = _answer(lambda: engines.vllm_plan(model, "80GiB", max_model_len=32768))
        out[f"llamacpp {model}"] = _answer(lambda: engines.llamacpp_plan(model, "24GiB", ctx_size=32768, parallel=4))
    out["compare"] = _answer(lambda: memory.compare(["deepseek-v3", "deepseek-v3.2", "deepseek-v4-flash",
                                                    "deepseek-v4-pro"], [131072, 1048576]))
    json.dump(out, sys.stdout, indent=1, sort_keys=True, default=str)
    sys.stdout.write("\n")


if __name__ == "__main__":
    main()
