"""A model folder with a real model's shape and random weights: time kveval where its weights cannot travel.

    python3 benchmarks/random_model.py SOURCE OUT [--seed 0] [--dtype bfloat16] [--config-only]

Throughput and memory depend on a model's shapes (layers, heads, KV heads,
head and hidden sizes, vocabulary), not on its weights' values, so a machine
that cannot download or receive a checkpoint (a lent GPU, a CI runner) can
still run ``benchmarks/throughput.py --model OUT`` and ``kveval sweep`` on it.
What it cannot give is accuracy: a random model answers no probe, so its
verdicts carry no information.

``SOURCE``: an embedded model name (``smollm2-135m``, ``gemma3-270m``) or a
folder holding ``config.json`` and the tokenizer's files. ``OUT`` receives the
configuration (``dtype`` set to ``--dtype``, the dtype a deployment caches in),
the tokenizer and, unless ``--config-only`` (a folder small enough to carry;
run the script again on the target machine to add the weights), weights drawn
by the architecture's own initialisation under ``torch.manual_seed(--seed)``.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source")
    parser.add_argument("out", type=Path)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--config-only", action="store_true")
    args = parser.parse_args()

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from kveval.modeling.sources import EMBEDDED

    if args.source in EMBEDDED:
        model, tokenizer = _embedded(args.source)
        config = model.config
    else:
        config = AutoConfig.from_pretrained(args.source)
        same = Path(args.source).resolve() == args.out.resolve()  # adding weights to a carried folder
        tokenizer = None if same else AutoTokenizer.from_pretrained(args.source)
    dtype = getattr(torch, args.dtype)
    config.dtype = dtype
    args.out.mkdir(parents=True, exist_ok=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(args.out)
    if args.config_only:
        config.save_pretrained(args.out)
    else:
        torch.manual_seed(args.seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.save_pretrained(args.out)
        print(f"{args.out}: {type(model).__name__}, {sum(p.numel() for p in model.parameters()):,} random parameters "
              f"({args.dtype}, seed {args.seed})")


def _embedded(name: str):
    from kveval.runner.models import load_model

    return load_model(name, device="cpu", dtype="float32", self_check=False)


if __name__ == "__main__":
    main()
