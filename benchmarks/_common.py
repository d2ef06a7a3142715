"""Set-up shared by the benchmarks that evaluate policies on probe items of an embedded model.

The scripts run as ``python3 benchmarks/<name>.py``, so this folder is on
``sys.path`` and they import it as ``from _common import ...``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path


def add_probe_options(parser: argparse.ArgumentParser, *, n: int, families: tuple[str, ...] = ("niah_multikey",),
                      length: int = 512) -> None:
    """The options of a probe benchmark: ``--model --dtype --family --length --n --batch-size --seed --depth --out``.

    ``n`` is the items per family, ``length`` the probe length in tokens;
    ``families`` are used when no ``--family`` is given.
    """
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto", help="compute dtype (float32, bfloat16; default: load_model's choice)")
    parser.add_argument("--family", action="append", default=None, help=f"probe family; repeat (default {', '.join(families)})")
    parser.add_argument("--length", type=int, default=length)
    parser.add_argument("--n", type=int, default=n, help="items per family")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0, help="probe seed (default 0)")
    parser.add_argument("--depth", type=float, action="append", default=None, help="needle depth; repeat (default the family's)")
    parser.add_argument("--out", default=None, help="run folder root (default: a temporary folder)")
    parser.set_defaults(default_families=list(families))


def families(args: argparse.Namespace) -> list[str]:
    """The probe families asked for (``--family``, else the benchmark's defaults)."""
    return args.family or args.default_families


def load_model_and_items(args: argparse.Namespace):
    """Load ``--model`` and generate ``--n`` items of ``--length`` tokens per family; ``(model, tokenizer, items)``."""
    from kveval.probes import generate_items
    from kveval.runner.models import load_model

    model, tokenizer = load_model(args.model, dtype=args.dtype)
    items = [it for family in families(args)
             for it in generate_items(family, tokenizer, args.length, args.n, depths=args.depth, seed=args.seed)]
    return model, tokenizer, items


def run_root(args: argparse.Namespace, prefix: str) -> Path:
    """Where the run folders go: ``--out``, else a new temporary folder named ``prefix...``."""
    return Path(args.out or tempfile.mkdtemp(prefix=prefix))


def specs_of(policies) -> list:
    """Policy specs as the RunSpecs ``evaluate_policies`` takes, in order (this script's edge)."""
    from kveval.runner.runspec import RunSpec

    return [RunSpec.parse(p) for p in policies]
