"""``kveval policies``: every policy with its parameters and a one-line description."""

from __future__ import annotations

from dataclasses import MISSING, fields


def configure(parser) -> None:
    parser.add_argument("--family", choices=["selection", "structure", "quantization"], help="only this family")


def run(args) -> int:
    from kveval.policies import POLICIES

    print("Stack one policy per family with '+': selection + structure + quantization, "
          'e.g. "snapkv(ratio=0.5)+kivi(bits=4)". ratio = fraction of context KV pairs removed.\n')
    for name, cls in sorted(POLICIES.items(), key=lambda kv: (kv[1].family, kv[0])):
        if args.family and cls.family != args.family:
            continue
        params = []
        for f in fields(cls):
            default = f.default if f.default is not MISSING else None
            params.append(f"{f.name}={default}" if default is not None else f.name)
        print(f"{name:<10} [{cls.family}] {cls.description}")
        if params:
            print(f"{'':<10} parameters: {', '.join(params)}")
    return 0
