"""Policy specs: every parameter has a declared type; streaming(ratio=); groups that compose; RunSpec."""

import dataclasses

import pytest
import torch

from kveval.cache.compressed import CompressedCache
from kveval.errors import PolicySpecError, UsageError
from kveval.policies.registry import POLICIES
from kveval.policies.spec import param_types, parse_policy
from kveval.runner.runspec import RunSpec
from kveval.tensors.scoring_state import ScoringState

from cache_runs import assert_one_line_error
from tiny_models import tiny_llama


@pytest.mark.parametrize("spec, message", [
    ("quant(bits=4,symmetric=maybe)", "symmetric=maybe is not true or false"),
    ("random(ratio=0.5,seed=abc)", "seed=abc is not an integer"),
    ("snapkv(ratio=0.5,ratio=0.25)", "parameter 'ratio' is given twice"),
    ("snapkv(budget=2.5)", "budget=2.5 is not an integer"),
    ("quant(bits=8.0)", "bits=8.0 is not an integer"),
    ("window(size=true)", "size=true is not an integer"),
    ("pyramidkv(ratio=0.5,beta=steep)", "beta=steep is not a number"),
    ("streaming(ratio=0.5,window=8)", "not both"),
    # a number past a float's range: math.isfinite raised OverflowError, an internal error
    ("pyramidkv(ratio=0.5,beta=" + "9" * 400 + ")", "is not a number"),
])
def test_wrongly_typed_or_repeated_values_are_one_clear_error(spec, message):
    assert_one_line_error(lambda: parse_policy(spec), PolicySpecError, message)


def test_typed_values_convert_and_floats_accept_ints():
    assert parse_policy("quant(bits=4,symmetric=TRUE)").quantization.symmetric is True
    assert parse_policy("quant(bits=4,symmetric=false)").quantization.symmetric is False
    assert parse_policy("random(ratio=0.5,seed=7)").selection.seed == 7
    beta = parse_policy("pyramidkv(ratio=0.5,beta=30)").selection.beta
    assert beta == 30.0 and isinstance(beta, float)
    assert parse_policy("snapkv(budget=64)").selection.budget == 64
    assert parse_policy("quant(bits=4,symmetric=true)").spec == "quant(bits=4,symmetric=true)"


def test_every_parameter_of_every_policy_has_a_declared_type():
    for cls in POLICIES.values():
        declared = param_types(cls)
        assert list(declared) == [f.name for f in dataclasses.fields(cls)]
        assert all(t.base in (bool, int, float, str) for t in declared.values())


def test_random_control_is_the_same_in_every_process():
    import subprocess
    import sys

    code = ("import torch; from kveval.policies.spec import parse_policy; from kveval.tensors.scoring_state import ScoringState;"
            "p = parse_policy('random(ratio=0.5,seed=3)').selection;"
            "s = ScoringState(torch.zeros(1, 8, 4), torch.arange(8)[None], None, 0, 1, seed=1);"
            "print(p.scores(s).argsort().tolist())")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout for _ in range(2)}
    assert len(runs) == 1


def _state(n: int) -> ScoringState:
    return ScoringState(torch.zeros(1, n, 4), torch.arange(n)[None], None, 0, 1)


def test_streaming_ratio_keeps_sinks_and_most_recent_as_kvpress():
    policy = parse_policy("streaming(sink=4,ratio=0.75)").selection
    n = 40
    keep = policy.keep_count(n)
    assert keep == 10  # ceil((1 - 0.75) * 40)
    kept = sorted(policy.scores(_state(n))[0].topk(keep).indices.tolist())
    assert kept == [0, 1, 2, 3] + list(range(n - (keep - 4), n))  # first sink tokens + most recent keep - sink
    assert policy.decode_budget is None  # as kvpress: the prefill is compressed, the cache then grows
    assert parse_policy("streaming(ratio=0.75)").ratio == 0.75


def test_every_selection_policy_takes_ratio():
    for name, cls in POLICIES.items():
        if cls.family == "selection" and not cls.thresholded:
            stack = parse_policy(f"{name}(ratio=0.5)")
            assert stack.ratio == 0.5 and stack.selection.keep_count(100) == 50, name
    # A threshold reaches a ratio of its own per item: asked for one, it names what it takes instead.
    assert_one_line_error(lambda: parse_policy("threshold(ratio=0.5)"), PolicySpecError,
                          "threshold has no parameter 'ratio'; parameters: scorer, threshold, window")


def test_streaming_ratio_compresses_the_prefill_on_a_model():
    model = tiny_llama()
    ids = torch.randint(1, 128, (1, 64), generator=torch.Generator().manual_seed(0))
    cache = CompressedCache(model, parse_policy("streaming(sink=4,ratio=0.5)"))
    with torch.no_grad():
        model(ids, cache=cache)
    assert [k[0] for k in cache.stats().kept_tokens] == [32, 32]


def test_default_group_adapts_to_low_rank_and_is_recorded():
    stack = parse_policy("lowrank(rank=16)+quant(bits=8)")
    assert stack.quantization.group == 16
    assert stack.spec == "lowrank(rank=16)+quant(bits=8,group=16)"
    assert parse_policy(stack.spec).spec == stack.spec
    assert parse_policy("lowrank(k_rank=12,v_rank=6)+quant(bits=8)").quantization.group == 6
    assert parse_policy("lowrank(rank=48)+kivi(bits=4)").quantization.group == 24  # largest divisor of 48 <= 32


def test_explicit_group_that_does_not_divide_stays_an_error():
    with pytest.raises(PolicySpecError, match="group=64 does not divide the k rank 16"):
        parse_policy("lowrank(rank=16)+quant(bits=8,group=64)")


def test_readme_stacking_example_runs_on_a_tiny_model():
    model = tiny_llama()  # head_dim 16
    spec = RunSpec.parse("lowrank(rank=8)+quant(bits=8)").for_model(model)
    assert spec.spec == "lowrank(rank=8)+quant(bits=8,group=8)"
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        model(ids, cache=CompressedCache(model, parse_policy(spec.policy)))


def test_spec_is_checked_against_the_model_config_before_loading():
    config = tiny_llama().config  # head_dim 16, default group 64 adapts
    assert RunSpec.parse("quant(bits=8)").for_model(config).spec == "quant(bits=8,group=16)"
    with pytest.raises(PolicySpecError, match="exceeds head_dim=16"):
        RunSpec.parse("lowrank(rank=32)").for_model(config)
    with pytest.raises(PolicySpecError, match="group=12 does not divide the k head_dim 16"):
        RunSpec.parse("quant(bits=8,group=12)").for_model(config)
    # the model's own spec is not changed for the next model
    spec = RunSpec.parse("quant(bits=8)")
    spec.for_model(config)
    assert spec.spec == "quant(bits=8)"


def test_runspec_parses_mode_suffix_and_kv_dtype_once():
    spec = RunSpec.parse("snapkv(ratio=0.5)@query", kv_dtype="bf16")
    assert (spec.spec, spec.mode, spec.kv_dtype, spec.kv_dtype_name) == ("snapkv(ratio=0.5)", "query", torch.bfloat16, "bfloat16")
    assert spec.key == "snapkv(ratio=0.5)@query@kv_dtype=bfloat16"
    assert RunSpec.parse(spec.key) == spec
    assert RunSpec.parse("none@query").effective_mode == "context"
    assert RunSpec.parse("kivi(bits=4)", mode="query").mode == "query"
    with pytest.raises(PolicySpecError, match="suffix after '@'"):
        RunSpec.parse("snapkv(ratio=0.5)@sideways")
    with pytest.raises(UsageError, match="kv_dtype='int3'"):
        RunSpec.parse("none", kv_dtype="int3")
    with pytest.raises(UsageError, match="give one"):
        RunSpec.parse("snapkv(ratio=0.5)@query", mode="context")
