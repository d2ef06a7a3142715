"""Compression policies. Importing this package registers every policy."""

from kveval.policies import duo, h2o, knorm, lowrank, none, pyramidkv, quant, random, snapkv, tova, window  # noqa: F401  (registration)
from kveval.policies import kvquant  # noqa: F401  (registration; its own line: helpers edit the one above)
from kveval.policies import latent  # noqa: F401  (registration; its own line, as kvquant)
from kveval.policies.base import (
    POLICIES,
    Policy,
    PolicyStack,
    RatioSelectionPolicy,
    RepresentationPolicy,
    ScoringState,
    SelectionPolicy,
    parse_policy,
    register_policy,
)

__all__ = [
    "POLICIES", "Policy", "PolicyStack", "RatioSelectionPolicy", "RepresentationPolicy",
    "ScoringState", "SelectionPolicy", "parse_policy", "register_policy",
]
