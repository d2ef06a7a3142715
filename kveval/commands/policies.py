"""``kveval policies``: every policy with its typed parameters and a one-line description."""

from __future__ import annotations

from kveval.policies.registry import POLICIES
from kveval.policies.spec import param_defaults, param_types


def configure(parser) -> None:
    parser.add_argument("--family", choices=["selection", "structure", "quantization"], help="only this family")


def run(args) -> int:
    print("Stack one policy per family with '+': selection + structure + quantization, "
          'e.g. "snapkv(ratio=0.5)+kivi(bits=4)". ratio = fraction of context KV pairs removed.\n'
          "Parameters are typed: bool takes true or false, int an integer, float any number; "
          "an unset quantization group adapts to the width it quantizes.\n")
    for name, cls in sorted(POLICIES.items(), key=lambda kv: (kv[1].family, kv[0])):
        if args.family and cls.family != args.family:
            continue
        defaults = param_defaults(cls)
        params = []
        for key, kind in param_types(cls).items():
            default = defaults[key]
            typed = f"{key}: {kind.base.__name__}"
            params.append(f"{typed}={str(default).lower() if isinstance(default, bool) else default}" if default is not None else typed)
        print(f"{name:<10} [{cls.family}] {cls.description}")
        if params:
            print(f"{'':<10} parameters: {', '.join(params)}")
    return 0
