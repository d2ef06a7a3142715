"""``kveval generate``: one prompt, greedy, under a policy; prints the answer and measured cache bytes."""

from __future__ import annotations

import json

from kveval.runner.generation import encode_prompt, generate
from kveval.runner import models  # models.load_model, looked up when called (tests stand a fake in)
from kveval.runner.runspec import RunSpec


def configure(parser) -> None:
    parser.add_argument("--model", default="smollm2-135m", help="embedded name, Hub id, folder or .gguf path (default: smollm2-135m)")
    parser.add_argument("--policy", default="none", help='policy spec, e.g. "snapkv(ratio=0.5)+kivi(bits=4)" (see `kveval policies`)')
    parser.add_argument("--prompt", required=True, help="the prompt text; '@file.txt' reads it from a file")
    parser.add_argument("--question", default="", help="text appended after compression (query-agnostic) or with it (--mode query)")
    parser.add_argument("--mode", default="context", choices=["context", "query"], help="compress before the question is seen (default) or with it")
    parser.add_argument("--kv-dtype", default=None, help="cache dtype of full-precision tokens and of the bytes baseline "
                                                         "(bfloat16, float16, float32; default: the model's deployment dtype)")
    parser.add_argument("--max-new-tokens", type=int, default=48, help="most tokens to generate (default 48)")
    parser.add_argument("--raw", action="store_true", help="do not apply the chat template")
    parser.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: CUDA when present, else CPU)")
    parser.add_argument("--dtype", default="auto",
                        help="compute dtype: float32, bfloat16, float16 or auto (default: bf16 on CUDA, fp32 on CPU)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--skip-self-check", action="store_true",
                        help="do not probe that kveval reproduces the model's own attention at load (Hub id/folder/file models)")


def run(args) -> int:
    # Parsed once and checked against the model's config.json: a bad spec fails before the weights load.
    spec = RunSpec.parse(args.policy, default_mode=args.mode, kv_dtype=args.kv_dtype).for_model(args.model)
    text = open(args.prompt[1:], encoding="utf-8").read() if args.prompt.startswith("@") else args.prompt
    model, tokenizer = models.load_model(args.model, device=args.device, dtype=args.dtype, self_check=not args.skip_self_check)
    prompt = encode_prompt(tokenizer, text, args.question, chat=False if args.raw else None)
    result = generate(model, tokenizer, [prompt], spec.policy, max_new_tokens=args.max_new_tokens, **spec.generation_kwargs())[0]
    stats = result.stats
    if args.json:
        print(json.dumps({"policy": spec.spec, "mode": spec.mode, "kv_dtype": spec.kv_dtype_name, "answer": result.text,
                          "tokens": prompt.length, "kv_bytes": stats.kv_bytes, "nominal_bytes": stats.nominal_bytes,
                          "ratio": stats.ratio, "index_bytes": stats.index_bytes, "state_bytes": stats.state_bytes,
                          "parts": stats.parts, "nominal_parts": stats.nominal_parts,
                          "kept_tokens_per_layer": [k[0] for k in stats.kept_tokens], "logprobs": result.logprobs}))
        return 0
    print(result.text)
    print(f"policy {spec.spec} | prompt {prompt.length} tokens | {stats.summary()} | "
          f"time to first token {result.prefill_seconds:.2f} s, {result.decode_tokens_per_second:.1f} tokens/s")
    return 0
