"""The policy families of a recorded spec (selection, structure, quantization: the README's three families), for the
leaderboard's *family* filter.

The report reads runs without loading the engine (whose policy classes import torch), so the built-in policies'
families are listed here by name; ``tests/test_report_plots.py`` holds this table equal to the policy registry's, so a
policy added to one and not the other fails the suite. A policy the table does not know (a plugin's) is ``other``.
"""

from __future__ import annotations

#: The families, in the order a stack applies them (:data:`kveval.policies.base.FAMILY_ORDER`).
FAMILIES = ("selection", "structure", "quantization")
#: Each built-in policy's family, by its registered name.
POLICY_FAMILIES: dict[str, str] = {
    **dict.fromkeys(("window", "streaming", "h2o", "snapkv", "pyramidkv", "tova", "knorm", "random", "keydiff",
                     "lagkv", "cur", "criticalkv", "chunkkv", "expected_attention", "threshold", "rkv", "duo",
                     "kvzip", "indexer"), "selection"),
    **dict.fromkeys(("lowrank", "latent", "share", "minicache"), "structure"),
    **dict.fromkeys(("quant", "kivi", "fp8", "fp4", "mxfp8", "kvquant", "llamacpp", "vllm", "sglang", "trtllm",
                     "deepseek_v41_storage"), "quantization"),
}
#: The family of a policy the table does not know.
OTHER = "other"


def spec_terms(spec: str) -> list[str]:
    """The policy names of a canonical spec, in order: ``"snapkv(ratio=0.5)+kivi(bits=4)"`` -> ``["snapkv", "kivi"]``;
    ``"none"`` -> ``[]``. A ``+`` inside a term's parentheses does not split it."""
    names, depth, start = [], 0, 0
    for k, ch in enumerate(spec + "+"):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "+" and depth == 0:
            name = spec[start:k].split("(", 1)[0].strip()
            if name and name != "none":
                names.append(name)
            start = k + 1
    return names


def spec_families(spec: str) -> list[str]:
    """The families of ``spec``'s policies, in :data:`FAMILIES` order (``other`` last); ``[]`` for ``none``."""
    found = {POLICY_FAMILIES.get(name, OTHER) for name in spec_terms(spec)}
    return [f for f in (*FAMILIES, OTHER) if f in found]


__all__ = ["FAMILIES", "OTHER", "POLICY_FAMILIES", "spec_families", "spec_terms"]
