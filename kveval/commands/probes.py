"""``kveval probes``: write long-context recall probe items as jsonlines.

Example::

    kveval probes --family niah_multikey --family passkey --length 512 --length 1024 \\
        --n 20 --depth 0 0.5 1 --seed 0 --model smollm2-135m --out probes.jsonl

Each line is :meth:`kveval.probes.ProbeItem.to_dict`; the file loads with
``datasets.load_dataset("json", data_files=...)`` and
:func:`kveval.probes.item.read_probe_items`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from kveval.errors import UsageError
from kveval.modeling.sources import load_tokenizer
from kveval.probes.families import FAMILIES, generate_items, resolve_families
from kveval.runs.records import atomic_write_text


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--family", action="append", required=True, metavar="F",
                        help="probe family (repeat for several, or 'all')")
    parser.add_argument("--length", action="append", type=int, metavar="TOKENS",
                        help="target prompt length in tokens of the model's tokenizer (repeatable; default 512)")
    parser.add_argument("--n", type=int, default=20, help="contexts per family and length (default 20)")
    parser.add_argument("--depth", nargs="+", type=float, metavar="D",
                        help="needle depths in [0, 1], cycled over items (default 0 0.25 0.5 0.75 1)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the items' needles and haystacks (default 0)")
    parser.add_argument("--model", default="smollm2-135m",
                        help="model whose tokenizer counts tokens (embedded name, Hub id, folder or .gguf)")
    parser.add_argument("--param", action="append", default=[], metavar="NAME=VALUE",
                        help="family parameter, e.g. haystack=prose or num_distractors=5; applied to the "
                             "selected families that take it")
    parser.add_argument("--out", default="-", help="output .jsonl file ('-' for stdout)")


def _parse_params(pairs: list[str]) -> dict:
    params = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise UsageError(f"--param {pair!r}: expected NAME=VALUE")
        params[name.strip()] = int(value) if value.strip().lstrip("-").isdigit() else value.strip()
    return params


def run(args: argparse.Namespace) -> int:
    families = resolve_families(args.family)
    if args.n < 1:
        raise UsageError(f"--n {args.n}: give the number of contexts per family and length, at least 1")
    lengths = args.length or [512]
    params = _parse_params(args.param)
    for name in params:
        if not any(name in FAMILIES[f].defaults for f in families):
            raise UsageError(f"--param {name}: no selected family takes it "
                             f"({'; '.join(f'{f}: ' + (', '.join(FAMILIES[f].defaults) or 'none') for f in families)})")
    tokenizer = load_tokenizer(args.model)
    tokenizer.kveval_name = args.model
    lines = []
    for family in families:
        fam_params = {k: v for k, v in params.items() if k in FAMILIES[family].defaults}
        for length in lengths:
            for item in generate_items(family, tokenizer, length, args.n, depths=args.depth, seed=args.seed, **fam_params):
                lines.append(json.dumps(item.to_dict(), sort_keys=True, ensure_ascii=False))
    text = "".join(line + "\n" for line in lines)
    if args.out == "-":
        sys.stdout.write(text)
    else:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out, text)
        print(f"kveval probes: wrote {len(lines)} items ({', '.join(families)}; lengths {', '.join(map(str, lengths))}) "
              f"to {out}", file=sys.stderr)
    return 0
