"""``kveval eval``: run probe items under one or more policies and write one run folder per policy."""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from kveval.errors import UsageError
from kveval.probes import resolve_families
from kveval.probes.sets import ProbeSet
from kveval.runner.evaluate import evaluate_policies
from kveval.runner import models  # models.load_model, looked up when called (tests stand a fake in)
from kveval.runner.runspec import check_lengths, parse_run_specs
from kveval.runs.records import iter_items, read_run_info
from kveval.runs.ownership import refuse_sweep_folder


def configure(parser) -> None:
    parser.add_argument("--model", default="smollm2-135m",
                        help="embedded name, Hub id, folder or .gguf path (default: smollm2-135m)")
    parser.add_argument("--policy", action="append", required=True, help="policy spec; repeat for several")
    parser.add_argument("--family", action="append", default=None, help="probe family or 'all'; repeat; default passkey")
    parser.add_argument("--length", action="append", type=int, default=None, help="prompt length in tokens; repeat")
    parser.add_argument("--depth", action="append", type=float, default=None, help="needle depth in [0, 1]; repeat")
    parser.add_argument("--n", type=int, default=10, help="items per family and length")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the probe items and of the random control policy (default 0)")
    parser.add_argument("--mode", default="context", choices=["context", "query"],
                        help="compress the context before the question is seen (default) or with it in view")
    parser.add_argument("--kv-dtype", default=None, help="cache dtype of full-precision tokens and of the bytes baseline "
                                                         "(bfloat16, float16, float32; default: the model's deployment dtype)")
    parser.add_argument("--batch-size", type=int, default=1,
                        help="items per forward pass (default 1); answers and bytes do not depend on it")
    parser.add_argument("--baseline", action="store_true", help="also run policy none")
    parser.add_argument("--fidelity", action="store_true",
                        help="teacher-force the baseline's answers through each policy: per-item KL, top-1 agreement, "
                             "answer log-prob change (needs --baseline; about doubles the run time)")
    parser.add_argument("--out", required=True, help="folder; runs go to OUT/runs/<model>/<policy>")
    parser.add_argument("--skip-self-check", action="store_true",
                        help="do not probe that kveval reproduces the model's own attention at load (Hub id/folder/file models)")


def run(args) -> int:
    refuse_sweep_folder(Path(args.out), "eval", "give --out a new folder, or add the policy to that config and "
                                                "run kveval sweep again")  # before anything loads
    if args.n < 1 or args.batch_size < 1:
        raise UsageError(f"--n {args.n} --batch-size {args.batch_size}: both count items, at least 1")
    # Parsed and checked against the model's config.json before the weights load.
    specs = parse_run_specs((["none"] if args.baseline else []) + list(args.policy), args.model, mode=args.mode,
                            kv_dtype=args.kv_dtype)
    check_lengths(args.model, args.length or [512], "--length")
    probe_set = ProbeSet(tokenizer=args.model, families=resolve_families(args.family or ["passkey"]),
                         lengths=args.length or [512], n=args.n, depths=args.depth, seed=args.seed)
    model, tokenizer = models.load_model(args.model, self_check=not args.skip_self_check)
    items = probe_set.items(tokenizer)
    with tqdm(total=len(items) * len(specs), desc="items x policies", unit="item") as bar:
        # Each run records the set its items came from: kveval rescore generates them again from it.
        dirs = evaluate_policies(model, tokenizer, items, specs, Path(args.out), args.model, args.batch_size,
                                 args.seed, bar, fidelity=args.fidelity, extra={"probe_sets": [probe_set.to_dict()]})
    for run_dir in dirs:
        info = read_run_info(run_dir)
        records = list(iter_items(run_dir))
        accuracy = sum(r.correct for r in records) / max(1, len(records))
        print(f"{info.policy:<50} accuracy {accuracy:.3f} ({len(records)} items)  {info.bytes_per_token:,.0f} B/token  -> {run_dir}")
    return 0
