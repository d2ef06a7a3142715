"""A quantization format and a selection policy defined here, outside kveval, through the declared policy contract
alone: registered, stacked, run through the cache, planned to the byte the cache measures, and run on DeepSeek V4's
own cache through the capabilities they declare; a policy declaring none of V4's is refused in one line before the
weights load. Nothing under kveval/ names them."""

from __future__ import annotations

import re
from dataclasses import dataclass

import pytest
import torch
from cache_runs import context_then_steps, random_ids
from tiny_models import tiny_model

from kveval.errors import PolicySpecError, UnsupportedModelError
from kveval.planner.memory import plan
from kveval.policies.base import Placement, PlannedCoding, QuantizationPolicy, RatioSelectionPolicy
from kveval.policies.registry import POLICIES, register_policy
from kveval.policies.spec import parse_policy
from kveval.stores.quantized import QuantizedSequence, QuantizedStore
from kveval.tensors.quant_format import TensorQuant


@dataclass
class SymmetricTokenInts(QuantizationPolicy):
    """Symmetric integers, one scale per ``group`` channels of a token, K and V alike; every token coded."""

    name = "plugin_ints"
    description = "test plug-in: symmetric per-token integers"
    placements = frozenset({Placement.PARTS})
    bits: int = 4
    group: int = 8

    @property
    def quant(self) -> TensorQuant:
        return TensorQuant(self.bits, "token", self.group, symmetric=True)

    def check_head_dim(self, head_dim: int) -> None:
        if head_dim % self.group:
            raise PolicySpecError(f"{self.spec()}: group={self.group} does not divide head_dim={head_dim}")

    def fit_widths(self, widths: dict[str, int], label: str) -> None:
        for width in widths.values():
            self.check_head_dim(width)

    def planned_coding(self) -> PlannedCoding:
        return PlannedCoding(self.quant, self.quant)

    def make_store(self, inner, model, layer_idx: int):
        return QuantizedStore(self.quant, self.quant, 0, inner.kv_dtype, inner.compute_dtype)

    def part_codes(self, model, layer_idx: int, part: str, width: int, kv_dtype, stride: int):
        return QuantizedSequence(self.quant.fitted(width), 0, kv_dtype)


@dataclass
class L1Keys(RatioSelectionPolicy):
    """Keeps the keys of largest L1 norm: scored by the key alone, so it acts on V4's compressed entries too."""

    name = "plugin_l1"
    description = "test plug-in: keep the keys of largest L1 norm"
    placements = frozenset({Placement.ENTRIES})

    def scores(self, state):
        return state.keys.float().abs().sum(dim=-1)


@dataclass
class HeadsOnly(L1Keys):
    """The same scores, declaring no placement on a model's own cache."""

    name = "plugin_heads_only"
    placements = frozenset()


PLUGINS = (SymmetricTokenInts, L1Keys, HeadsOnly)
STACK = "plugin_l1(ratio=0.5)+plugin_ints(bits=4)"


@pytest.fixture(autouse=True)
def plugins():
    for cls in PLUGINS:
        register_policy(cls)
    yield
    for cls in PLUGINS:
        POLICIES.pop(cls.name, None)


def test_registered_and_stacked():
    stack = parse_policy(STACK)
    assert type(stack.selection) is L1Keys and type(stack.quantization) is SymmetricTokenInts
    assert stack.spec == STACK and parse_policy(stack.spec).spec == STACK
    with pytest.raises(PolicySpecError, match="did you mean 'plugin_l1'"):
        parse_policy("plugin_l2(ratio=0.5)")


@pytest.mark.parametrize("spec", ["plugin_ints(bits=4,group=8)", "plugin_l1(ratio=0.5)", STACK])
def test_the_plan_is_the_bytes_the_cache_measures(spec):
    """Through kveval's cache on a tiny Llama: 100 tokens, then 6 decode steps."""
    model = tiny_model("llama")
    _, cache = context_then_steps(model, spec, random_ids(100, 1), random_ids(6, 2), kv_dtype=torch.bfloat16)
    measured = cache.stats()
    planned = plan(model.config, 100, policy=parse_policy(spec), dtype_bytes=2, new_tokens=6)
    assert measured.kv_bytes < measured.nominal_bytes
    assert (planned.sequence_bytes, planned.baseline_sequence_bytes) == (measured.kv_bytes, measured.nominal_bytes)


@pytest.mark.parametrize("spec", ["plugin_ints(bits=4,group=8)", STACK])
def test_on_deepseek_v4_through_the_declared_capabilities(spec):
    """V4's window, CSA/HCA entries and indexer keys coded by the plug-in format (its ``part_codes``), its entries
    selected by the plug-in selection: every part as planned."""
    model = tiny_model("deepseek_v4")
    for context, steps in ((37, 5), (50, 13)):
        planned = plan(model.config, context, new_tokens=steps, dtype_bytes=4, policy=parse_policy(spec))
        _, cache = context_then_steps(model, spec, random_ids(context, 1), random_ids(steps, 2), kv_dtype=torch.float32)
        stats = cache.stats()
        parts = {p.name: p.bytes for p in planned.parts if p.name != "state"}
        assert set(parts) == {"window", "csa", "indexer", "hca"}
        assert parts == stats.parts, (context, steps)
        assert planned.sequence_bytes == stats.kv_bytes + sum(p.bytes for p in planned.parts if p.name == "state")
        assert stats.kv_bytes < stats.nominal_bytes


def test_a_policy_without_a_v4_capability_is_refused():
    message = "plugin_heads_only(ratio=0.5): is not one of the selections checked on V4's compressed entries"
    with pytest.raises(UnsupportedModelError, match=re.escape(message)):
        context_then_steps(tiny_model("deepseek_v4"), "plugin_heads_only(ratio=0.5)", random_ids(8, 1),
                           random_ids(1, 2))
    with pytest.raises(ValueError, match="plugin_l1"):  # the refusal names the plug-in that declares it
        plan(tiny_model("deepseek_v4").config, 100, policy=parse_policy("plugin_heads_only(ratio=0.5)"))


def test_the_cli_refuses_it_in_one_line_before_the_weights_load(tmp_path, capsys, monkeypatch):
    from test_architectures import _save_with_tokenizer

    from kveval.commands.main import main
    from kveval.runner import models

    _save_with_tokenizer(tiny_model("deepseek_v4", attn="eager"), tmp_path)
    monkeypatch.setattr(models, "load_model", lambda *a, **k: pytest.fail("the weights loaded"))
    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path), "--prompt", "w5 w6 w7", "--policy",
                 "plugin_heads_only(ratio=0.5)+plugin_ints"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not one of the selections checked on V4's compressed entries" in err[0], err


@pytest.mark.slow
def test_run_in_a_sweep_to_a_report_and_a_gate(tmp_path):
    """The plug-ins as a sweep config names them, over a saved tiny Llama folder: every run written, the leaderboard
    lists them with measured bytes below the baseline's, and the gate judges each."""
    import json

    from test_architectures import _save_with_tokenizer

    from kveval.commands.main import main

    folder = tmp_path / "tiny-llama"
    _save_with_tokenizer(tiny_model("llama", attn="eager"), folder)
    config = tmp_path / "sweep.yaml"
    config.write_text(f"name: plugins\nmodels: ['{folder}']\nbatch_size: 2\nkv_dtype: float32\n"
                      f"policies: ['plugin_ints(bits=4,group=8)', '{STACK}']\n"
                      "probes: {families: [passkey], lengths: [96], depths: [0.5], n: 2}\n")
    out = tmp_path / "out"
    assert main(["sweep", str(config), "--out", str(out), "--quiet"]) == 0
    rows = {r["policy"]: r for r in json.loads((out / "report" / "leaderboard.json").read_text())["rows"]}
    assert set(rows) == {"none", "plugin_ints(bits=4)", STACK}  # group=8 is the default: the canonical spec drops it
    assert all(rows[p]["bytes_per_token"] < rows["none"]["bytes_per_token"] for p in rows if p != "none")
    gate = json.loads((out / "gate" / "gate.json").read_text())
    judged = {c["name"].split("/", 1)[1].split("@")[0]: c["status"] for r in gate.get("results", [gate])
              for c in r["candidates"]}
    assert set(judged) == {"plugin_ints(bits=4)", STACK}
    assert set(judged.values()) <= {"PASS", "FAIL", "INCONCLUSIVE"}
