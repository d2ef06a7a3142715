"""The policy registry: every policy class under its spec name, and nothing else.

The built-in policies are listed here, one line each (:data:`BUILTINS`: spec name -> the module and class that
define it); each module is imported the first time its name is looked up, so parsing ``quant(bits=4)`` imports
the quantizers alone (and no torch). Importing a policy module registers nothing: what exists is what this file
says. A policy from outside kveval joins with :func:`register_policy`. The registry refuses a name that is taken
and anything that is not a concrete :class:`Policy`, as lm-evaluation-harness's registries do.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Iterator, MutableMapping

from kveval.errors import PolicyRegistryError
from kveval.policies.base import Placement, Policy

#: The built-in policies: spec name -> (module, class). Policies declaring a capability are listed in this order
#: wherever a refusal names those that have it (:mod:`kveval.policies.compatibility`).
BUILTINS: dict[str, tuple[str, str]] = {
    "window": ("kveval.policies.window", "WindowPolicy"),
    "streaming": ("kveval.policies.window", "StreamingPolicy"),
    "knorm": ("kveval.policies.knorm", "KnormPolicy"),
    "random": ("kveval.policies.random", "RandomPolicy"),
    "indexer": ("kveval.policies.indexer", "IndexerPolicy"),
    "duo": ("kveval.policies.duo", "DuoPolicy"),
    "h2o": ("kveval.policies.h2o", "H2OPolicy"),
    "pyramidkv": ("kveval.policies.pyramidkv", "PyramidKVPolicy"),
    "snapkv": ("kveval.policies.snapkv", "SnapKVPolicy"),
    "tova": ("kveval.policies.tova", "TOVAPolicy"),
    "keydiff": ("kveval.policies.keydiff", "KeyDiffPolicy"),
    "lagkv": ("kveval.policies.lagkv", "LagKVPolicy"),
    "cur": ("kveval.policies.cur", "CURPolicy"),
    "criticalkv": ("kveval.policies.criticalkv", "CriticalKVPolicy"),
    "chunkkv": ("kveval.policies.chunkkv", "ChunkKVPolicy"),
    "threshold": ("kveval.policies.threshold", "ThresholdPolicy"),
    "expected_attention": ("kveval.policies.expected_attention", "ExpectedAttentionPolicy"),
    "rkv": ("kveval.policies.rkv", "RKVPolicy"),
    "kvzip": ("kveval.policies.kvzip", "KVzipPolicy"),
    "lowrank": ("kveval.policies.lowrank", "LowRankPolicy"),
    "latent": ("kveval.policies.latent", "LatentPolicy"),
    "share": ("kveval.policies.share", "SharePolicy"),
    "minicache": ("kveval.policies.minicache", "MiniCachePolicy"),
    "quant": ("kveval.policies.quant", "QuantPolicy"),
    "kivi": ("kveval.policies.quant", "KiviPolicy"),
    "fp8": ("kveval.policies.quant", "Fp8Policy"),
    "fp4": ("kveval.policies.fp4", "Fp4Policy"),
    "mxfp8": ("kveval.policies.mxfp8", "Mxfp8Policy"),
    "kvquant": ("kveval.policies.kvquant", "KVQuantPolicy"),
    "llamacpp": ("kveval.policies.llamacpp", "LlamaCppPolicy"),
    "vllm": ("kveval.policies.vllm", "VllmPolicy"),
    "sglang": ("kveval.policies.sglang", "SglangPolicy"),
    "trtllm": ("kveval.policies.trtllm", "TrtllmPolicy"),
    "deepseek_v41_storage": ("kveval.policies.deepseek_v41", "DeepseekV41StoragePolicy"),
    "none": ("kveval.policies.none", "NoCompression"),
}

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def _check_class(cls) -> None:
    """Refuse anything but a concrete :class:`Policy` with a lower-case ``name`` and a family."""
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise PolicyRegistryError(f"register_policy takes a Policy subclass, not {cls!r}")
    if inspect.isabstract(cls) or not cls.family:
        raise PolicyRegistryError(f"{cls.__qualname__} is abstract or declares no family: only a concrete policy can be registered")
    if not _NAME.match(cls.name or ""):
        raise PolicyRegistryError(f"{cls.__qualname__}.name={cls.name!r}: a policy name is lower-case letters, digits and '_'")


class PolicyTable(MutableMapping):
    """Spec name -> policy class, a built-in's module imported on first lookup. Iterating gives the names alone
    (nothing imported); reading a class (``[]``, ``get``, ``items``, ``values``) imports its module."""

    def __init__(self, builtins: dict[str, tuple[str, str]]):
        self._entries: dict[str, type[Policy] | tuple[str, str]] = dict(builtins)

    def __getitem__(self, name: str) -> type[Policy]:
        entry = self._entries[name]
        if isinstance(entry, tuple):
            module, qualname = entry
            cls = vars(importlib.import_module(module))[qualname]
            _check_class(cls)
            if cls.name != name:
                raise PolicyRegistryError(f"{module}.{qualname} is listed as {name!r} but is named {cls.name!r}")
            self._entries[name] = entry = cls
        return entry

    def __setitem__(self, name: str, cls: type[Policy]) -> None:
        self._entries[name] = cls

    def __delitem__(self, name: str) -> None:
        del self._entries[name]

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._entries))

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name) -> bool:
        return name in self._entries


#: Spec name -> policy class. Read it; add to it only through :func:`register_policy`.
POLICIES = PolicyTable(BUILTINS)


def register_policy(cls: type[Policy]) -> type[Policy]:
    """Make ``cls`` available to :func:`kveval.policies.spec.parse_policy` under ``cls.name``; returns ``cls``.

    Raises
    ------
    PolicyRegistryError
        ``cls`` is not a concrete :class:`Policy` subclass with a lower-case ``name`` and a family, or its
        name is already registered by another class.
    """
    _check_class(cls)
    taken = POLICIES.get(cls.name)
    if taken is not None and taken is not cls:
        raise PolicyRegistryError(f"policy name {cls.name!r} is already registered by {taken.__module__}.{taken.__qualname__}; "
                                  f"choose another name for {cls.__module__}.{cls.__qualname__}")
    POLICIES[cls.name] = cls
    return cls


def supporting(placement: Placement, family: str) -> list[str]:
    """The names of the registered policies of ``family`` that declare ``placement``, in registry order (every
    policy module imported: a refusal's list of what would run)."""
    return [name for name, cls in POLICIES.items() if cls.family == family and placement in cls.placements]


__all__ = ["BUILTINS", "POLICIES", "PolicyTable", "register_policy", "supporting"]
