"""``kveval memory``: the KV-cache memory planner on the command line."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from kveval.errors import UsageError
from kveval.gate.verify import check_gate_file, judged_models, read_gate_file
from kveval.planner.engines import (
    format_engine_plan,
    join_verdicts,
    kv_cache_dtype_presets,
    llamacpp_plan,
    sglang_plan,
    vllm_plan,
)
from kveval.planner.memory import (
    FitResult,
    compare,
    concurrency,
    format_compare,
    format_concurrency,
    format_plan,
    max_fit,
    parse_headroom,
    parse_tokens,
    plan,
)
from kveval.planner.model_specs import load_model_spec, preset_names
from kveval.planner.native import FORMATS
from kveval.planner.parallel import Deployment
from kveval.policies.spec import parse_policy
from kveval.runs.records import atomic_write_text


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model", nargs="?", help=f"preset ({', '.join(preset_names())}), config.json path or folder, "
                        f".gguf file, or Hub id (a preset's id plans that preset, with no download)")
    parser.add_argument("--context", help="context tokens, e.g. 8192 or 8k (k = 1024)")
    parser.add_argument("--batch", type=int, default=None, help="sequences (default 1)")
    parser.add_argument("--policy", default="none", help="policy spec, e.g. 'snapkv(ratio=0.5)+kivi(bits=2)' (default none)")
    parser.add_argument("--dtype-bytes", type=int, default=2, help="bytes per cached value: 2 = fp16/bf16 (default), 4 = fp32")
    parser.add_argument("--new-tokens", default="0", help="tokens generated after the context (default 0)")
    parser.add_argument("--gpu-memory", help="GPU memory, e.g. 80GiB: also report the largest context and batch that fit")
    parser.add_argument("--weights", help="model weights, e.g. 16GB or bytes (default: as a .gguf's tensors or an FP8 "
                        "checkpoint store them, else parameters x --weight-bytes-per-param)")
    parser.add_argument("--weight-bytes-per-param", type=float, help="bytes per parameter for the estimate (default: "
                        "the checkpoint's where known, else --dtype-bytes)")
    parser.add_argument("--headroom", default="0.1", help="fraction of the GPU kept free for activations etc. (default 0.1; or 10%%)")
    parser.add_argument("--storage", help=f"per-part storage of the native cache (policy none), e.g. "
                        f"'indexer=fp8-128,latent=bf16' or 'all=bf16'; formats: {', '.join(FORMATS)}")
    parser.add_argument("--compare", metavar="MODELS", help="compare the native caches of MODELS (comma-separated, "
                        "in order) at --context (comma-separated, e.g. 128k,1m), each against the one before")
    parser.add_argument("--concurrency", metavar="BATCHES", help="with --compare: the total cache of each model at "
                        "each of BATCHES (comma-separated, e.g. 1,2,4,8) and what one more request adds")
    parser.add_argument("--engine", choices=("vllm", "sglang", "llamacpp"), help="answer in a serving engine's terms: "
                        "the KV pool it allocates on each GPU of --gpu-memory and what fits at each of its presets "
                        "(docs/engines.md, docs/planner.md)")
    parser.add_argument("--gpu-memory-utilization", "--mem-fraction-static", type=float, default=0.9,
                        help="vLLM: fraction of the GPU it may use; SGLang: --mem-fraction-static (default 0.9)")
    parser.add_argument("--max-model-len", "--context-length", help="vLLM/SGLang: tokens a sequence may reach, read "
                        "as vLLM reads it: 32k = 32,000, 32K = 32,768")
    parser.add_argument("--max-num-seqs", "--max-running-requests", type=int, default=256,
                        help="vLLM/SGLang: sequences running at once in each DP rank (default 256)")
    parser.add_argument("--tensor-parallel-size", "--tp", type=int, default=1, help="vLLM/SGLang: tensor-parallel "
                        "ranks (default 1): per-head K/V split by KV heads, MLA and V4 caches replicated on each")
    parser.add_argument("--data-parallel-size", "--dp", type=int, default=1, help="vLLM/SGLang: data-parallel ranks, "
                        "each with its own requests and KV pool (default 1)")
    parser.add_argument("--enable-dp-attention", action="store_true", help="SGLang: --dp attention groups inside "
                        "the --tp GPUs (vLLM's --data-parallel-size is data-parallel attention already)")
    parser.add_argument("--block-size", "--page-size", type=int, help="vLLM block / SGLang page, in tokens (default: "
                        "the engine's for the model: docs/planner.md)")
    parser.add_argument("--ctx-size", help="llama.cpp: KV cells shared by the slots, e.g. 32k")
    parser.add_argument("--parallel", type=int, default=1, help="llama.cpp: slots sharing --ctx-size (default 1)")
    parser.add_argument("--overhead", default="0", help="engine: memory besides weights and KV (activations, CUDA graphs, "
                        "compute buffers), e.g. 2GiB (default 0)")
    parser.add_argument("--presets", help="engine: ';'-separated policy specs to answer at (default: the engine's presets)")
    parser.add_argument("--kv-cache-dtype", help="vLLM, SGLang: answer at this --kv-cache-dtype beside the model dtype, e.g. nvfp4, "
                        "int4_per_token_head or fp8_ds_mla (DeepSeek V3.2/V4): the preset vllm(kv_cache_dtype=...)")
    parser.add_argument("--gate", metavar="GATE_JSON", help="engine: a gate.json (or the folder holding it) whose "
                        "verdicts on this model are shown beside each preset")
    parser.add_argument("--layers", action="store_true", help="print every layer")
    parser.add_argument("--list-presets", action="store_true", help="list the named presets and exit")
    parser.add_argument("--json", nargs="?", const="-", metavar="PATH", help="write JSON (to stdout, or to PATH)")


def run(args: argparse.Namespace) -> int:
    if args.list_presets:
        for name in preset_names():
            print(f"{name:20s} {load_model_spec(name).describe}")
        return 0
    if args.compare:
        return _compare(args)
    if args.concurrency:
        raise UsageError("--concurrency goes with --compare MODELS --context N, e.g. --compare "
                         "deepseek-v3,deepseek-v4.1-flash --context 32k,128k --concurrency 1,2,4,8")
    if args.engine:
        return _engine(args)
    if not args.model:
        raise UsageError(f"give a model: a preset ({', '.join(preset_names())}), a config.json path, a .gguf or a "
                         f"Hub id")
    headroom = parse_headroom(args.headroom)
    policy = parse_policy(args.policy)
    new_tokens = parse_tokens(args.new_tokens, "new_tokens")
    batch = 1 if args.batch is None else args.batch
    if batch < 1:
        raise UsageError(f"batch={batch} must be >= 1")
    context = parse_tokens(args.context) if args.context is not None else None
    if context is None and not args.gpu_memory:
        raise UsageError("give --context N (e.g. 8k), or --gpu-memory to find the largest context that fits")
    if context is not None and context < 1:
        raise UsageError(f"context={context} must be a positive number of tokens")
    spec = load_model_spec(args.model)
    fits: list[FitResult] = []
    if args.gpu_memory:
        kwargs = dict(policy=policy, dtype_bytes=args.dtype_bytes, headroom=headroom, new_tokens=new_tokens,
                      weight_bytes_per_param=args.weight_bytes_per_param, storage=args.storage)
        fits.append(max_fit(spec, args.gpu_memory, args.weights, batch=batch, **kwargs))
        if context is not None:
            fits.append(max_fit(spec, args.gpu_memory, args.weights, context=context, **kwargs))
    if context is not None:
        shown = context
    elif fits[0].value is None:  # bounded cache: show it at the model's full length
        shown = spec.max_position or max(w for w in spec.windows if w)
    else:
        shown = max(fits[0].value, 1)
    p = plan(spec, shown, batch, policy, args.dtype_bytes, new_tokens, storage=args.storage)
    _emit(args.json, {"plan": p.to_dict(), "fit": [f.to_dict() for f in fits]}, format_plan(p, fits, args.layers))
    return 0


def _engine(args: argparse.Namespace) -> int:
    """``--engine``: the engine's KV pool and what fits in it, at each preset."""
    if not args.model or not args.gpu_memory:
        raise UsageError(f"--engine {args.engine} needs a model and --gpu-memory, e.g. llama-3.1-8b --gpu-memory 80GiB")
    presets = [p.strip() for p in args.presets.split(";") if p.strip()] if args.presets else None
    if args.kv_cache_dtype:
        presets = kv_cache_dtype_presets(args.engine, args.kv_cache_dtype, presets)
    common = dict(weights=args.weights, overhead=args.overhead, dtype_bytes=args.dtype_bytes, presets=presets,
                  weight_bytes_per_param=args.weight_bytes_per_param)
    parallel = Deployment(args.tensor_parallel_size, args.data_parallel_size, args.enable_dp_attention)
    if args.engine == "vllm":
        if not args.max_model_len:
            raise UsageError("--engine vllm needs --max-model-len, e.g. 32k")
        p = vllm_plan(args.model, args.gpu_memory, gpu_memory_utilization=args.gpu_memory_utilization,
                      max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs, deployment=parallel,
                      block_size=args.block_size, **common)  # vLLM's grammar
    elif args.engine == "sglang":
        if not args.max_model_len:
            raise UsageError("--engine sglang needs --context-length (or --max-model-len), e.g. 128k")
        p = sglang_plan(args.model, args.gpu_memory, mem_fraction_static=args.gpu_memory_utilization,
                        context_length=args.max_model_len, max_running_requests=args.max_num_seqs, deployment=parallel,
                        page_size=args.block_size, **common)
    else:
        if parallel != Deployment() or args.block_size is not None:
            raise UsageError("--engine llamacpp runs on one GPU here: drop --tensor-parallel-size, "
                             "--data-parallel-size, --enable-dp-attention and --block-size")
        if not args.ctx_size:
            raise UsageError("--engine llamacpp needs --ctx-size, e.g. 32k")
        p = llamacpp_plan(args.model, args.gpu_memory, ctx_size=parse_tokens(args.ctx_size, "ctx_size"),
                          parallel=args.parallel, **common)
    if args.gate:
        join_verdicts(p, _read_gate(args.gate, p.model))
    _emit(args.json, p.to_dict(), format_engine_plan(p))
    return 0


def _read_gate(where: str, model: str) -> dict:
    """``gate.json`` at ``where`` (a file, or a folder holding one), its verdicts derived again from its runs
    (:func:`~kveval.gate.verify.check_gate_file`); refused where it judged no run of ``model``."""
    data, path = read_gate_file(where)
    judged = judged_models(data)
    if model not in judged:
        raise UsageError(f"--gate {where}: judged {', '.join(judged)}, not {model}; give the gate of a sweep of "
                         f"{model}, or plan {judged[0]}")
    check_gate_file(data, path)
    return data


def _emit(where: str | None, data: dict, table: str) -> None:
    """The table, or JSON to stdout (``-``), or JSON to a file and the table."""
    if where == "-":
        print(json.dumps(data, indent=2))
        return
    if where is not None:
        atomic_write_text(Path(where), json.dumps(data, indent=2) + "\n")
    print(table)


def _compare(args: argparse.Namespace) -> int:
    if args.model:
        raise UsageError(f"give the models to compare in --compare only (got {args.model!r} as well)")
    if args.policy != "none" or args.gpu_memory or args.new_tokens != "0":
        raise UsageError("--compare plans each model's native cache (policy none) at --context; drop --policy, "
                         "--gpu-memory and --new-tokens")
    if not args.context:
        raise UsageError("give --context with --compare, e.g. --context 128k,1m")
    models = [m.strip() for m in args.compare.split(",") if m.strip()]
    contexts = [parse_tokens(c.strip()) for c in args.context.split(",") if c.strip()]
    if args.concurrency:
        if args.batch is not None:
            raise UsageError("--concurrency gives the batches; drop --batch")
        batches = []
        for text in args.concurrency.split(","):
            try:
                batches.append(int(text.strip()))
            except ValueError:
                raise UsageError(f"--concurrency {args.concurrency!r}: give whole numbers, e.g. 1,2,4,8") from None
        table = concurrency(models, contexts, batches, args.dtype_bytes, args.storage)
        _emit(args.json, table.to_dict(), format_concurrency(table))
        return 0
    result = compare(models, contexts, 1 if args.batch is None else args.batch, args.dtype_bytes, args.storage)
    _emit(args.json, result.to_dict(), format_compare(result))
    return 0
