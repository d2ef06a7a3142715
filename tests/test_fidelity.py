"""Fidelity metrics: the baseline's own answer teacher-forced through the compressed model."""

import json

import numpy as np
import pytest
import torch
from test_run_folders import CharTok, _items

from kveval.errors import UsageError
from kveval.gate.config import GateConfig
from kveval.policies.spec import parse_policy
from kveval.runner.evaluate import evaluate_policies
from kveval.runner.fidelity import answer_distributions, compare_distributions
from kveval.runner.generation import Prompt, generate
from kveval.runs.fidelity import FIDELITY_FILE, read_fidelity
from kveval.stats.comparison import compare_runs
from kveval.stats.fidelity import items_to_separate, kl_bounds

from cache_runs import specs_of
from tiny_models import Tok, tiny_llama


def _prompts(seed=3):
    g = torch.Generator().manual_seed(seed)
    return [Prompt(torch.randint(1, 128, (n,), generator=g).tolist(), torch.randint(1, 128, (q,), generator=g).tolist())
            for n, q in [(48, 4), (64, 3), (40, 6), (56, 5)]]


def _fidelity(model, prompts, spec, mode="context"):
    reference = answer_distributions(model, Tok(), prompts, parse_policy("none"), max_new_tokens=6, mode=mode)
    forced = answer_distributions(model, Tok(), prompts, parse_policy(spec), answers=[a for a, _ in reference], mode=mode)
    return [compare_distributions(a, p, q[1]) for (a, p), q in zip(reference, forced)]


def test_the_baseline_pass_is_the_baseline_greedy_answer():
    model, prompts = tiny_llama(), _prompts()
    reference = answer_distributions(model, Tok(), prompts, parse_policy("none"), max_new_tokens=6)
    assert [a for a, _ in reference] == [r.token_ids for r in generate(model, Tok(), prompts, parse_policy("none"), max_new_tokens=6)]
    assert all(d.shape == (6, 128) for _, d in reference)


@pytest.mark.parametrize("mode", ["context", "query"])
def test_none_gives_kl_exactly_zero_and_full_agreement(mode):
    for row in _fidelity(tiny_llama(), _prompts(), "none", mode):
        assert row["kl_mean"] == 0.0 and row["kl_max"] == 0.0
        assert row["top1_agreement"] == 1.0 and row["answer_logprob_delta"] == 0.0
        assert row["positions"] == 6


@pytest.mark.parametrize("weak, strong", [("quant(bits=8,group=8)", "quant(bits=2,group=8)"),
                                          ("snapkv(ratio=0.25,window=4)", "snapkv(ratio=0.75,window=4)")])
def test_kl_grows_as_compression_grows(weak, strong):
    model, prompts = tiny_llama(), _prompts()
    kl_weak = np.mean([r["kl_mean"] for r in _fidelity(model, prompts, weak)])
    kl_strong = np.mean([r["kl_mean"] for r in _fidelity(model, prompts, strong)])
    assert 0 < kl_weak < kl_strong
    assert np.mean([r["top1_agreement"] for r in _fidelity(model, prompts, strong)]) <= 1.0


def test_kl_of_a_known_pair_of_distributions():
    p = torch.log(torch.tensor([[0.5, 0.5, 0.0]], dtype=torch.float64))
    q = torch.log(torch.tensor([[0.25, 0.75, 1e-30]], dtype=torch.float64))
    row = compare_distributions([0], p, q)
    expected = 0.5 * np.log(0.5 / 0.25) + 0.5 * np.log(0.5 / 0.75)  # the zero-probability token adds nothing
    assert row["kl_mean"] == pytest.approx(expected, rel=1e-12)
    assert row["top1_agreement"] == 0.0  # argmax 0 (tie, first) against 1
    assert row["answer_logprob_delta"] == pytest.approx(np.log(0.25) - np.log(0.5))


def _items_of_different_lengths():
    items = _items("the pass key is 42. " * 3, n=2) + _items("a longer haystack, the pass key is 42. " * 4, n=2)
    for i, item in enumerate(items):
        item.id, item.max_new_tokens = f"passkey-{i}", 4
    return items


@pytest.mark.parametrize("spec", ["kivi(bits=2,group=4,residual=4)", "h2o(ratio=0.5,decode_budget=40)"])
def test_fidelity_does_not_depend_on_the_batch_size(tmp_path, spec):
    model, items = tiny_llama(), _items_of_different_lengths()
    found = []
    for batch in (1, 3):
        dirs = evaluate_policies(model, CharTok(), items, specs_of(["none", spec]), tmp_path / f"b{batch}", "org/M", batch_size=batch,
                                 fidelity=True)
        assert not (dirs[0] / FIDELITY_FILE).exists()  # the baseline is the reference, not a candidate
        found.append(read_fidelity(dirs[1]))
    assert sorted(found[0]) == sorted(found[1]) == sorted(it.id for it in items)
    for key, one in found[0].items():
        many = found[1][key]
        # Same answer, same positions; a padded batch computes the logits to float rounding (~5e-7), not bit for bit.
        assert (one.positions, one.top1_agreement) == (many.positions, many.top1_agreement)
        assert one.kl_mean == pytest.approx(many.kl_mean, rel=1e-2, abs=1e-6)
        assert one.kl_max == pytest.approx(many.kl_max, rel=1e-2, abs=1e-6)
        assert one.answer_logprob_delta == pytest.approx(many.answer_logprob_delta, abs=1e-4)
    assert any(f.kl_mean > 1e-5 for f in found[0].values())  # the policy does change the distributions


def test_fidelity_reaches_the_comparison_and_resumes(tmp_path):
    model, items = tiny_llama(), _items_of_different_lengths()
    base, cand = evaluate_policies(model, CharTok(), items, specs_of(["none", "quant(bits=2,group=8)"]), tmp_path, "org/M", fidelity=True)
    before = (cand / FIDELITY_FILE).read_text()
    evaluate_policies(model, CharTok(), items, specs_of(["none", "quant(bits=2,group=8)"]), tmp_path, "org/M", fidelity=True)
    assert (cand / FIDELITY_FILE).read_text() == before  # nothing measured twice
    found = read_fidelity(cand)
    summary = compare_runs(base, cand, n_resamples=200, cells=False).overall.fidelity
    assert summary["n"] == len(items)
    assert summary["kl_mean"] == pytest.approx(np.mean([f.kl_mean for f in found.values()]))
    assert summary["kl_mean_upper"] >= summary["kl_mean"] >= summary["kl_mean_lower"] > 0
    assert compare_runs(base, base, n_resamples=200, cells=False).overall.fidelity is None


def test_a_half_written_fidelity_line_is_measured_again(tmp_path):
    model, items = tiny_llama(), _items_of_different_lengths()
    _, cand = evaluate_policies(model, CharTok(), items, specs_of(["none", "window(size=8)"]), tmp_path, "org/M", fidelity=True)
    full = (cand / FIDELITY_FILE).read_text()
    (cand / FIDELITY_FILE).write_text(full[: full.rfind("\n", 0, len(full) - 1) + 10])
    assert len(read_fidelity(cand)) == len(items) - 1
    evaluate_policies(model, CharTok(), items, specs_of(["none", "window(size=8)"]), tmp_path, "org/M", fidelity=True)
    assert sorted((cand / FIDELITY_FILE).read_text().splitlines()) == sorted(full.splitlines())


def test_fidelity_needs_the_baseline_in_the_same_call(tmp_path):
    with pytest.raises(UsageError, match="--baseline"):
        evaluate_policies(tiny_llama(), CharTok(), _items(), specs_of(["window(size=8)"]), tmp_path, "org/M", fidelity=True)


def test_kl_bounds():
    assert kl_bounds([]) == (0.0, float("inf"))
    assert kl_bounds([0.0, 0.0, 0.0]) == (0.0, 0.0)
    x = np.random.default_rng(0).exponential(0.1, 200)
    low, high = kl_bounds(x)
    assert x.mean() - 4 * x.std() / np.sqrt(x.size) < low < x.mean() < high < x.mean() + 4 * x.std() / np.sqrt(x.size)


def test_a_continuous_signal_separates_with_fewer_items_than_accuracy():
    rng = np.random.default_rng(1)
    n = 30
    kl_a = rng.exponential(0.05, n)
    kl_b = kl_a + rng.exponential(0.02, n)  # paired: every item a little further from the baseline
    right_a = np.ones(n)
    right_b = (rng.random(n) > 0.1).astype(float)  # 1 item in 10 flips
    by_kl = items_to_separate(kl_a, kl_b, "wilcoxon", n_resamples=100)
    by_accuracy = items_to_separate(right_a, right_b, "mcnemar", n_resamples=100)
    assert by_kl is not None and by_kl <= 10
    assert by_accuracy is None or by_accuracy > 2 * by_kl
    with pytest.raises(ValueError):
        items_to_separate([1.0], [1.0, 2.0], "wilcoxon")


@pytest.fixture(scope="module")
def fidelity_runs(tmp_path_factory):
    """A baseline and two runs measured with fidelity, and one without, of the tiny model (12 items)."""
    root = tmp_path_factory.mktemp("fidelity")
    items = [it for k in range(3) for it in _items_of_different_lengths()]
    for i, item in enumerate(items):
        item.id = f"passkey-{i}"
    model = tiny_llama()
    base, int8, int2 = evaluate_policies(model, CharTok(), items, specs_of(["none", "quant(bits=8,group=8)", "quant(bits=2,group=8)"]),
                                         root, "org/M", batch_size=4, fidelity=True)
    [plain] = evaluate_policies(model, CharTok(), items, specs_of(["window(size=8)"]), root, "org/M", batch_size=4)
    return root, base, int8, int2, plain


def test_gate_rule_max_mean_kl(fidelity_runs):
    from kveval.errors import ConfigError
    from kveval.gate.config import load_gate_config
    from kveval.gate.rules import evaluate_gate

    assert GateConfig().max_mean_kl == {} and load_gate_config("configs/gate.yaml").max_mean_kl == {}  # off by default
    assert GateConfig.from_dict({"max_mean_kl": 0.1}).kl_limit("any") == 0.1
    assert GateConfig.from_dict({"max_mean_kl": {"passkey": 0.1}}).kl_limit("other") is None
    with pytest.raises(ConfigError, match="max_mean_kl"):
        GateConfig.from_dict({"max_mean_kl": -1})
    _, base, int8, int2, plain = fidelity_runs
    kl2 = read_fidelity(int2)
    mean2 = np.mean([f.kl_mean for f in kl2.values()])
    rules = {"margin": 0.5, "max_negative_flip_rate": None, "max_confusion_increase": None, "n_resamples": 500}

    def reasons(cap, run):
        result = evaluate_gate(GateConfig.from_dict({**rules, "max_mean_kl": cap}), base, [run])
        return [r for t in result.candidates[0].tasks for r in t.reasons if "KL" in r]

    assert any("lower bound" in r and "> cap" in r for r in reasons(mean2 / 10, int2))  # FAIL: clearly above the cap
    assert reasons(mean2 * 10, int2) == []  # shown under the cap
    assert reasons(None, int2) == []  # rule off
    assert any("--fidelity" in r for r in reasons(1.0, plain))  # not measured: never passes silently
    assert evaluate_gate(GateConfig.from_dict({**rules, "max_mean_kl": mean2 / 10}), base, [int2]).exit_code == 1


def test_compare_and_report_show_the_kl(fidelity_runs, tmp_path):
    from kveval.report.leaderboard import build_report
    from kveval.stats.tables import format_table

    root, base, int8, int2, plain = fidelity_runs
    table = format_table(compare_runs(base, int2, n_resamples=200, cells=False))
    assert " KL " in table.splitlines()[4] and "fidelity, the baseline's answer teacher-forced" in table
    assert " KL " not in format_table(compare_runs(base, plain, n_resamples=200, cells=False))
    paths = build_report([root], tmp_path / "report", n_resamples=200)
    assert any(p.name == "kl_vs_compression.png" for p in paths["plots"])
    md = paths["markdown"].read_text()
    assert "| KL |" in md and "*KL*" in md
    rows = {r["policy"]: r for r in json.loads(paths["json"].read_text())["rows"]}
    assert rows["quant(bits=8,group=8)"]["fidelity_kl_mean"] < rows["quant(bits=2,group=8)"]["fidelity_kl_mean"]
    assert "fidelity_kl_mean" not in rows["window(size=8)"]
