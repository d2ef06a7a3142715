"""The policy registry: every policy class under its spec name, and nothing else.

The built-in policies are listed here, one line each: importing a policy module registers nothing, so
what exists is what this file says. A policy from outside kveval joins with :func:`register_policy`.
The registry refuses a name that is taken and anything that is not a concrete :class:`Policy`,
as lm-evaluation-harness's registries do.
"""

from __future__ import annotations

import inspect
import re

from kveval.errors import PolicyRegistryError
from kveval.policies import (
    chunkkv,
    criticalkv,
    cur,
    duo,
    engines,
    expected_attention,
    h2o,
    indexer,
    keydiff,
    knorm,
    kvquant,
    kvzip,
    lagkv,
    latent,
    lowrank,
    none,
    pyramidkv,
    quant,
    random,
    rkv,
    snapkv,
    threshold,
    tova,
    window,
)
from kveval.policies.base import Policy

#: Spec name -> policy class. Read it; add to it only through :func:`register_policy`.
POLICIES: dict[str, type[Policy]] = {}

_NAME = re.compile(r"^[a-z][a-z0-9_]*$")


def register_policy(cls: type[Policy]) -> type[Policy]:
    """Make ``cls`` available to :func:`kveval.policies.spec.parse_policy` under ``cls.name``; returns ``cls``.

    Raises
    ------
    PolicyRegistryError
        ``cls`` is not a concrete :class:`Policy` subclass with a lower-case ``name`` and a family, or its
        name is already registered by another class.
    """
    if not (isinstance(cls, type) and issubclass(cls, Policy)):
        raise PolicyRegistryError(f"register_policy takes a Policy subclass, not {cls!r}")
    if inspect.isabstract(cls) or not cls.family:
        raise PolicyRegistryError(f"{cls.__qualname__} is abstract or declares no family: only a concrete policy can be registered")
    if not _NAME.match(cls.name or ""):
        raise PolicyRegistryError(f"{cls.__qualname__}.name={cls.name!r}: a policy name is lower-case letters, digits and '_'")
    taken = POLICIES.get(cls.name)
    if taken is not None and taken is not cls:
        raise PolicyRegistryError(f"policy name {cls.name!r} is already registered by {taken.__module__}.{taken.__qualname__}; "
                                  f"choose another name for {cls.__module__}.{cls.__qualname__}")
    POLICIES[cls.name] = cls
    return cls


for _builtin in (
    duo.DuoPolicy,
    h2o.H2OPolicy,
    knorm.KnormPolicy,
    lowrank.LowRankPolicy,
    none.NoCompression,
    pyramidkv.PyramidKVPolicy,
    quant.QuantPolicy,
    quant.KiviPolicy,
    quant.Fp8Policy,
    random.RandomPolicy,
    snapkv.SnapKVPolicy,
    tova.TOVAPolicy,
    window.WindowPolicy,
    window.StreamingPolicy,
    kvquant.KVQuantPolicy,
    latent.LatentPolicy,
    engines.LlamaCppPolicy,
    engines.VllmPolicy,
    engines.SglangPolicy,
    engines.TrtllmPolicy,
    keydiff.KeyDiffPolicy,
    lagkv.LagKVPolicy,
    cur.CURPolicy,
    criticalkv.CriticalKVPolicy,
    chunkkv.ChunkKVPolicy,
    threshold.ThresholdPolicy,
    expected_attention.ExpectedAttentionPolicy,
    indexer.IndexerPolicy,
    rkv.RKVPolicy,
    kvzip.KVzipPolicy,
):
    register_policy(_builtin)
