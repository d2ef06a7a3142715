"""How many concurrent requests of 1M tokens DeepSeek V3, V3.2, V4-Flash and V4.1-Flash fit on 8 x H200, in vLLM and
in SGLang, at each engine's usual deployments: the table in docs/planner.md ("DeepSeek deployments as served").

    python3 scripts/deepseek_deployments.py                 # the table
    python3 scripts/deepseek_deployments.py --context 128K  # another length

Each cell is :func:`kveval.planner.engines.vllm_plan` / :func:`~kveval.planner.engines.sglang_plan` (the same as
``kveval memory MODEL --engine vllm|sglang --gpu-memory 143771MiB --tp ... --max-model-len 1M``): requests of the
full length that all KV pools hold, at the engine's default KV dtype (``none``: each model's cache as served) and,
where the engine offers it on that model, its FP8 cache. Weights are the checkpoints' own precision (FP8 blocks; V4's
routed experts MXFP4); V4.1-Flash's are not known here and are taken as V4-Flash's (an assumption, printed).
"""

from __future__ import annotations

import argparse
import dataclasses

from kveval.planner.engines import sglang_plan, vllm_plan
from kveval.planner.fit import stored_weights
from kveval.planner.model_specs import load_model_spec
from kveval.planner.parallel import Deployment

MODELS = ("deepseek-v3", "deepseek-v3.2", "deepseek-v4-flash", "deepseek-v4.1-flash")
#: An H200's memory as nvidia-smi reports it (143,771 MiB).
H200 = "143771MiB"
DEPLOYMENTS = (
    ("vllm", "TP8", Deployment(8, 1)),
    ("vllm", "DP8 (TP1)", Deployment(1, 8)),
    ("sglang", "TP8", Deployment(8, 1)),
    ("sglang", "TP8 DP8 dp-attn", Deployment(8, 8, True)),
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", default="1M", help="tokens a request reaches, read as vLLM reads it (1M = 1,048,576)")
    parser.add_argument("--fraction", type=float, default=0.9, help="--gpu-memory-utilization / --mem-fraction-static")
    args = parser.parse_args()
    flash = load_model_spec("deepseek-v4-flash")
    print(f"8 x H200 ({H200} each), requests of {args.context} tokens, fraction {args.fraction:g}, overhead 0: "
          f"concurrent requests (all KV pools), default KV dtype / FP8 KV")
    head = f"{'model':20s} {'weights':>9s}" + "".join(f" {engine + ' ' + name:>24s}" for engine, name, _ in DEPLOYMENTS)
    print(head)
    for model in MODELS:
        spec = load_model_spec(model)
        assumed = stored_weights(spec, []) is None
        if assumed:  # V4.1-Flash: V4-Flash's parameters, split and precision
            spec = dataclasses.replace(spec, num_parameters=flash.num_parameters, weights=flash.weights)
        cells = []
        for engine, _, deployment in DEPLOYMENTS:
            if engine == "vllm":
                p = vllm_plan(spec, H200, gpu_memory_utilization=args.fraction, max_model_len=args.context,
                              deployment=deployment, max_num_seqs=1 << 20)
            else:
                p = sglang_plan(spec, H200, mem_fraction_static=args.fraction, context_length=args.context,
                                deployment=deployment, max_running_requests=1 << 20)
            none = next(f.concurrent for f in p.presets if f.preset == "none")
            fp8 = next((f.concurrent for f in p.presets if f.preset != "none"), None)
            cells.append(f"{none} / {'-' if fp8 is None else fp8}")
        size = stored_weights(spec, [])[0] / 1e9
        print(f"{model:20s} {size:>7.0f}GB{'*' if assumed else ' '}" + "".join(f" {c:>24s}" for c in cells))
    print("* weights assumed: V4-Flash's (V4.1-Flash's parameter count is not public here)")
    print("- : the engine has no FP8 preset kveval can put on that cache (V3.2, V4 and V4.1 are served in their own "
          "FP8/FP4 formats by default)")


if __name__ == "__main__":
    main()
