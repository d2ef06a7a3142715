"""The policy registry (:mod:`kveval.policies.registry`): what is registered is what the file lists, and it refuses
a taken name or anything that is not a concrete policy."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from typing import ClassVar

import pytest

from kveval.errors import PolicyRegistryError
from kveval.policies.base import Policy, RatioSelectionPolicy, SelectionPolicy
from kveval.policies.knorm import KnormPolicy
from kveval.policies.registry import POLICIES, register_policy
from kveval.policies.spec import parse_policy


def test_every_builtin_is_registered_once_under_its_own_name():
    assert all(name == cls.name for name, cls in POLICIES.items())
    assert {"none", "window", "streaming", "h2o", "snapkv", "pyramidkv", "tova", "knorm", "random", "duo",
            "lowrank", "latent", "quant", "kivi", "fp8", "fp4", "mxfp8", "kvquant", "llamacpp", "vllm", "sglang",
            "trtllm", "keydiff", "lagkv", "cur", "criticalkv", "chunkkv", "expected_attention", "threshold", "indexer",
            "rkv", "kvzip", "deepseek_v41_storage", "share", "minicache"} == set(POLICIES)


def test_a_taken_name_is_refused_and_the_first_class_stays():
    @dataclass
    class Impostor(RatioSelectionPolicy):
        name: ClassVar[str] = "knorm"

        def scores(self, state):
            return state.positions.float()

    with pytest.raises(PolicyRegistryError, match="'knorm' is already registered by kveval.policies.knorm.KnormPolicy"):
        register_policy(Impostor)
    assert POLICIES["knorm"] is KnormPolicy
    assert register_policy(KnormPolicy) is KnormPolicy  # registering the same class again changes nothing


@pytest.mark.parametrize("thing", [object, "knorm", KnormPolicy(ratio=0.5), int, Policy, SelectionPolicy])
def test_anything_but_a_concrete_policy_class_is_refused(thing):
    with pytest.raises(PolicyRegistryError):
        register_policy(thing)


def test_a_family_member_missing_part_of_its_contract_is_abstract():
    """A selection policy without ``scores`` cannot be built or registered: the contract is declared, not duck-typed."""
    @dataclass
    class Unscored(RatioSelectionPolicy):
        name: ClassVar[str] = "unscored_test"

    with pytest.raises(TypeError, match="abstract"):
        Unscored(ratio=0.5)
    with pytest.raises(PolicyRegistryError, match="abstract"):
        register_policy(Unscored)


def test_a_new_policy_registers_and_parses():
    @dataclass
    class Newest(RatioSelectionPolicy):
        name: ClassVar[str] = "newest_test"
        description: ClassVar[str] = "keep the newest tokens (a test policy)"

        def scores(self, state):
            return state.positions.float()

    try:
        assert register_policy(Newest) is Newest and POLICIES["newest_test"] is Newest
        assert isinstance(parse_policy("newest_test(ratio=0.25)").selection, Newest)
    finally:
        POLICIES.pop("newest_test", None)


def test_importing_a_policy_module_registers_nothing():
    """Registration is the registry's list, not an import side effect."""
    code = ("import sys; import kveval.policies.knorm; "
            "print('kveval.policies.registry' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
