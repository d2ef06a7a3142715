"""The presses kvpress users compare against (KeyDiff, LagKV, CUR, CriticalKV, ChunkKV, threshold): each scored on a
hand-computed case, then run on every architecture of the matrix."""

import math

import pytest
import torch

from kveval.cache.compressed import CompressedCache
from kveval.cache.exactness import prefill_and_decode
from kveval.errors import PolicySpecError, UnsupportedModelError
from kveval.modeling.architectures import mla_dims
from kveval.policies.criticalkv import projected_norms
from kveval.policies.spec import parse_policy
from kveval.tensors.scoring_state import ScoringState

from tiny_models import ARCHITECTURES, tiny_model

F64 = torch.float64


def _state(keys=None, values=None, attention=None, model=None):
    some = next(x for x in (keys, values, attention) if x is not None)
    heads, n = some.shape[0], some.shape[1]
    return ScoringState(keys=keys, positions=torch.arange(n).expand(heads, n), attention=attention, layer_idx=0,
                        num_layers=1, model=model, values=values)


def _selection(spec):
    return parse_policy(spec).selection


def _kept(policy, state):
    scores = policy.scores(state)
    return policy.choose(scores, policy.keep_count(scores.shape[-1]), state).tolist()


def test_keydiff_scores_minus_the_cosine_to_the_mean_unit_key():
    # Unit keys [1,0], [0,1], [1,0]: anchor [2/3, 1/3], |anchor| = sqrt(5)/3, so cosines 2/sqrt(5), 1/sqrt(5).
    policy = _selection("keydiff(ratio=0.6)")
    keys = torch.tensor([[[3.0, 0.0], [0.0, 2.0], [1.0, 0.0]]], dtype=F64)  # norms differ: only directions count
    expected = torch.tensor([[-2 / math.sqrt(5), -1 / math.sqrt(5), -2 / math.sqrt(5)]], dtype=F64)
    torch.testing.assert_close(policy.scores(_state(keys)).double(), expected, rtol=1e-6, atol=1e-7)
    assert _kept(policy, _state(keys)) == [[1, 2]] or _kept(policy, _state(keys)) == [[0, 1]]  # ceil(0.4 x 3) = 2
    assert 1 in _kept(_selection("keydiff(ratio=0.9)"), _state(keys))[0]  # the one distinct key is kept first


def test_cur_multiplies_key_and_value_leverage_normalised_in_local_blocks():
    keys = torch.tensor([[[1.0, 0.0], [0.0, 2.0], [3.0, 0.0]]], dtype=F64)  # squared norms 1, 4, 9
    values = torch.tensor([[[2.0, 0.0], [1.0, 0.0], [0.0, 1.0]]], dtype=F64)  # squared norms 4, 1, 1
    whole = _selection("cur(ratio=0.5,sink=0,local_window=0)").scores(_state(keys, values))
    torch.testing.assert_close(whole.double(), torch.tensor([[4 / 17, 4 / 17, 9 / 17]], dtype=F64))
    # Blocks of 2: k2 -> [0.2, 0.8 | 1], v2 -> [0.8, 0.2 | 1]; products [0.16, 0.16, 1] over their sum 1.32.
    local = _selection("cur(ratio=0.5,sink=0,local_window=2)").scores(_state(keys, values))
    torch.testing.assert_close(local.double(), torch.tensor([[0.16 / 1.32, 0.16 / 1.32, 1 / 1.32]], dtype=F64))
    sunk = _selection("cur(ratio=0.5,sink=1,local_window=2)").scores(_state(keys, values))
    assert sunk[0, 0] == float("inf") and sunk[0, 2] == local[0, 2]
    assert _kept(_selection("cur(ratio=0.6,sink=1,local_window=2)"), _state(keys, values)) == [[0, 2]]


def test_lagkv_normalises_each_partition_by_the_next_ones_range():
    # sink 1, lag 2, 6 tokens: token 0 sink; tokens 1-2 scored against the reference 3-4; 3-5 kept (no reference).
    keys = torch.tensor([[[9, 9], [1, 1], [0, 2], [0, 0], [2, 2], [5, 5]]], dtype=F64)
    values = torch.tensor([[[9, 9], [1, 0.5], [0, 0], [0, 0], [1, 1], [5, 5]]], dtype=F64)
    # Keys normalised by [0, 2]: [.5, .5] (std 0), [0, 1] (std sqrt(.5)); values by [0, 1]: [1, .5] (std sqrt(.125)),
    # [0, 0] (std 0). Softmaxed in the partition and averaged: token 1 (0.3302 + 0.5875) / 2 < token 2, so ranks 0, 1.
    key_soft = torch.tensor([0.0, math.sqrt(0.5)]).softmax(0)
    value_soft = torch.tensor([math.sqrt(0.125), 0.0]).softmax(0)
    assert float((key_soft + value_soft)[0]) < float((key_soft + value_soft)[1])
    policy = _selection("lagkv(ratio=0.5,sink=1,lag=2)")
    assert policy.scores(_state(keys, values)).tolist() == [[1.0, 0.0, 0.5, 1.0, 1.0, 1.0]]
    # Shorter than sink + 2 lag: recency, as the reference falls back to.
    short = policy.scores(_state(keys[:, :4], values[:, :4]))
    torch.testing.assert_close(short, torch.tensor([[1.0, 0.0, 1 / 3, 2 / 3]]))


class _Attention(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.layer_idx = 0
        self.o_proj = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        self.o_proj.weight.data = weight


class _Model(torch.nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.attn = _Attention(weight)


def test_criticalkv_reweights_the_second_stage_by_the_projected_value_norm():
    # One query head of width 2 through W_o = diag(1, 2): ||v W_o^T||_1 = |v0| + 2 |v1|.
    model = _Model(torch.tensor([[1.0, 0.0], [0.0, 2.0]]))
    values = torch.tensor([[[1.0, 0.0], [0.0, 5.0], [1.0, 1.0], [1.0, 0.0]]])
    assert projected_norms(values, model, 0).tolist() == [[1.0, 10.0, 3.0, 1.0]]
    attention = torch.tensor([[0.4, 0.1, 0.3, 0.2]])
    policy = _selection("criticalkv(ratio=0.25,window=1,kernel=1)")  # keep 3; the first stage int(1.5) = 1: the window
    scores = policy.scores(_state(attention=attention, values=values, model=model))
    eps = 1e-4
    torch.testing.assert_close(scores[0, :3], torch.tensor([(0.4 + eps) * 1, (0.1 + eps) * 10, (0.3 + eps) * 3]))
    # The window's attention is its queries' mean (kvpress's scale, which epsilon meets): window=2 halves the sum.
    halved = _selection("criticalkv(ratio=0.25,window=2,kernel=1)").scores(_state(attention=attention, values=values, model=model))
    torch.testing.assert_close(halved[0, :2], torch.tensor([(0.2 + eps) * 1, (0.05 + eps) * 10]))
    assert scores[0, 3] == float("inf")
    # SnapKV alone would keep 0, 2, 3; the value through W_o trades token 0 for token 1.
    assert _kept(policy, _state(attention=attention, values=values, model=model)) == [[1, 2, 3]]
    assert _kept(_selection("snapkv(ratio=0.25,window=1,kernel=1)"), _state(attention=attention)) == [[0, 2, 3]]
    # No output projection to read (model None): the value's own L1 norm.
    assert projected_norms(values, None, 0).tolist() == [[1.0, 5.0, 2.0, 1.0]]


def test_chunkkv_keeps_whole_chunks_by_their_mean_head_summed_score():
    attention = torch.tensor([[0.1, 0.3, 0.5, 0.4, 0.0], [0.3, 0.1, 0.0, 0.1, 0.0]])
    # The window token scores the largest finite score, 0.5, in each head; summed over heads [.4, .4, .5, .5, 1];
    # chunks of 2: means 0.4, 0.5, 1.0 (the last chunk is one token).
    policy = _selection("chunkkv(ratio=0.4,window=1,kernel=1,chunk=2)")
    scores = policy.scores(_state(attention=attention))
    torch.testing.assert_close(scores, torch.tensor([[0.4, 0.4, 0.5, 0.5, 1.0]] * 2))
    assert _kept(policy, _state(attention=attention)) == [[2, 3, 4]] * 2  # ceil(0.6 x 5) = 3: two best chunks
    # 4 kept: the best chunks whole, then the first token of the next.
    assert _kept(_selection("chunkkv(ratio=0.2,window=1,kernel=1,chunk=2)"), _state(attention=attention)) == [[0, 2, 3, 4]] * 2


def test_threshold_keeps_what_its_scorer_rates_above_it_and_the_window():
    # knorm scores minus the key norm: norms 1, 5, 2, 4, 3 in head 0; 6, 6, 6, 6, 1 in head 1.
    keys = torch.tensor([[[1.0, 0.0], [3.0, 4.0], [0.0, 2.0], [4.0, 0.0], [0.0, 3.0]],
                         [[6.0, 0.0], [0.0, 6.0], [6.0, 0.0], [0.0, 6.0], [1.0, 0.0]]])
    policy = _selection("threshold(scorer=knorm,threshold=-3.5,window=1)")
    assert policy.keep_count(5) == 5 and policy.per_head_budgets and policy.nominal_ratio is None
    chosen = policy.choose(policy.scores(_state(keys)), 5, _state(keys))
    # Head 0: norms below 3.5 (tokens 0, 2, 4), the window's token 4; head 1: token 4 only (window and the best).
    assert [c.tolist() for c in chosen] == [[0, 2, 4], [4]]
    no_window = _selection("threshold(scorer=knorm,threshold=-5.5,window=0)")
    assert [c.tolist() for c in no_window.choose(no_window.scores(_state(keys)), 5, _state(keys))] == [[0, 1, 2, 3, 4], [4]]
    # Nothing above the threshold and no window: each head still keeps its best token.
    none_above = _selection("threshold(scorer=knorm,threshold=0,window=0)")
    assert [c.tolist() for c in none_above.choose(none_above.scores(_state(keys)), 5, _state(keys))] == [[0], [4]]
    assert _selection("threshold(scorer=cur)").reads_values and not _selection("threshold(scorer=keydiff)").reads_values


def test_expected_attention_scores_the_softmax_of_the_expected_logit_times_the_value_norm():
    # No RoPE hook (model None): mu = [1, 0], covariance diag(0, 8/3) over the 3 queries.
    queries = torch.tensor([[[1.0, 0.0], [1.0, 2.0], [1.0, -2.0]]])
    keys = torch.tensor([[[2.0, 0.0], [0.0, 1.0], [0.0, 0.0]]])
    values = torch.tensor([[[1.0, 0.0], [0.0, 2.0], [3.0, 0.0]]])
    state = ScoringState(keys=keys, positions=torch.arange(3)[None], attention=None, layer_idx=0, num_layers=1,
                         values=values, queries=queries, query_positions=torch.arange(3))
    # Mean alone: k . mu / sqrt(2) = [sqrt(2), 0, 0]; the covariance adds k^T S k / (2 x 2) = [0, 2/3, 0].
    plain = _selection("expected_attention(ratio=0.5,sink=0,covariance=false,vnorm=false)").scores(state)
    torch.testing.assert_close(plain, torch.tensor([[math.sqrt(2), 0.0, 0.0]]).softmax(-1))
    full = _selection("expected_attention(ratio=0.5,sink=0,vnorm=false)").scores(state)
    torch.testing.assert_close(full, torch.tensor([[math.sqrt(2), 2 / 3, 0.0]]).softmax(-1))
    normed = _selection("expected_attention(ratio=0.5,sink=0)").scores(state)
    torch.testing.assert_close(normed, full * torch.tensor([[1.0, 2.0, 3.0]]))
    # A sink stays, and leaves the statistics and the softmax: mu = [1, 0], S = diag(0, 4) from queries 1 and 2.
    sunk = _selection("expected_attention(ratio=0.5,sink=1,vnorm=false)").scores(state)
    assert sunk[0, 0] == float("inf")
    torch.testing.assert_close(sunk[0, 1:], torch.tensor([4 / 4, 0.0]).softmax(-1))


def test_expected_attention_takes_queries_back_before_rope_and_averages_the_future_rotation():
    from kveval.modeling.rope import rope_hook
    from kveval.policies.expected_attention import query_statistics

    from tiny_models import tiny_llama

    model = tiny_llama()
    hook = rope_hook(model, 0)
    d = model.config.head_dim
    q = torch.randn(2, 1, d, generator=torch.Generator().manual_seed(0))
    positions = torch.arange(10)
    rotated = hook.rotate(q.expand(2, 10, d), positions.expand(2, 10))  # one query, at ten positions
    mu, cov = query_statistics(rotated, positions, model, 0, 0, 7, d, True)
    future = torch.arange(10, 17)
    expected = hook.rotate(q.expand(2, 7, d), future.expand(2, 7)).mean(dim=1)  # mean of R(p) q over the next 7
    torch.testing.assert_close(mu, expected, rtol=1e-5, atol=1e-5)
    assert float(cov.abs().max()) < 1e-4  # one query before RoPE: no spread


def test_h2o_mean_divides_the_attention_by_the_queries_that_saw_each_token():
    # Positions 0-3 under causal attention are seen by 4, 3, 2, 1 queries.
    attention = torch.tensor([[4.0, 1.5, 2.0, 0.5]])
    state = ScoringState(keys=None, positions=torch.arange(4)[None], attention=attention, layer_idx=0, num_layers=1)
    assert _selection("h2o(ratio=0.5,recent=0,mean=true)").scores(state).tolist() == [[1.0, 0.5, 1.0, 0.5]]
    assert _selection("h2o(ratio=0.5,recent=0)").scores(state).tolist() == [[4.0, 1.5, 2.0, 0.5]]  # the paper's sum
    assert _selection("h2o(ratio=0.5,recent=1,mean=true)").scores(state).tolist() == [[1.0, 0.5, 1.0, float("inf")]]


def test_pyramidkv_takes_kvpress_layer_schedule():
    # 494 tokens, ratio 0.5, window 64, 30 layers: average 247; the first layer is capped at 494 - 64 = 430, so the
    # last keeps 2 x 247 - 430 = 64, the steps (430 - 64) / 29 between, each rounded.
    policy = _selection("pyramidkv(ratio=0.5,window=64,schedule=kvpress)")
    counts = [policy.keep_count(494, i, 30) for i in range(30)]
    assert counts[0] == 430 and counts[-1] == 64 and counts[1] == round(430 - 366 / 29)
    assert sorted(counts, reverse=True) == counts
    # The paper's schedule (the default): 2 x 247 - 247/20 = 481.65 down to 12.35, ceiled.
    paper = _selection("pyramidkv(ratio=0.5,window=64)")
    assert [paper.keep_count(494, i, 30) for i in (0, 29)] == [482, 13]
    # Too short for the window's floor: every layer the average, rounded as kvpress (round half to even).
    assert {policy.keep_count(100, i, 30) for i in range(30)} == {50}


@pytest.mark.parametrize("spec, message", [
    ("pyramidkv(ratio=0.5,schedule=steep)", "schedule='steep' must be paper or kvpress"),
    ("expected_attention(ratio=0.5,future=0)", "future=0 must be a positive"),
    ("threshold(scorer=snapkv)", "scorer='snapkv' is not one of knorm, keydiff, cur, lagkv"),
    ("cur(ratio=0.5,leverage=sum)", "leverage='sum' must be one of"),
    ("lagkv(ratio=0.5,lag=0)", "lag=0 must be a positive"),
    ("criticalkv(ratio=0.5,first_stage=2)", "first_stage=2.0 must be in [0, 1]"),
    ("chunkkv(ratio=0.5,chunk=0)", "chunk=0 must be a positive"),
    ("chunkkv(ratio=0.5,adaptive=true)", "adaptive=true changes nothing"),
    ("keydiff(ratio=0.5,decode_budget=8)", "decode_budget is not supported"),
])
def test_bad_parameters_are_one_clear_error(spec, message):
    with pytest.raises(PolicySpecError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_policy(spec)


PRESSES = ["keydiff(ratio=0.5)", "lagkv(ratio=0.5,lag=8)", "cur(ratio=0.5)", "criticalkv(ratio=0.5)",
           "chunkkv(ratio=0.5,chunk=4)", "cur(ratio=0.5,adaptive=true)",
           "threshold(scorer=keydiff,threshold=-0.5,window=8)", "expected_attention(ratio=0.5,future=16)"]


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_presses_run_on_the_architecture_matrix_below_nominal_bytes(name):
    model = tiny_model(name)
    ids = torch.randint(3, 128, (1, 64), generator=torch.Generator().manual_seed(1))
    for spec in PRESSES:
        cache = CompressedCache(model, parse_policy(spec))
        if spec.startswith("expected_attention") and mla_dims(model.config) is not None:
            with pytest.raises(UnsupportedModelError, match="an MLA latent cache"):  # queries do not meet a latent
                with torch.no_grad():
                    prefill_and_decode(model, cache, ids, 2)
            continue
        with torch.no_grad():
            logits = prefill_and_decode(model, cache, ids, 2)
        stats = cache.stats()
        assert all(bool(torch.isfinite(x).all()) for x in logits), spec
        assert 0 < stats.kv_bytes < stats.nominal_bytes, spec


def test_threshold_runs_record_the_ratio_each_item_reached(tmp_path):
    from test_run_folders import CharTok, _items

    from kveval.report.leaderboard import to_markdown
    from kveval.report.rows import collect_rows
    from kveval.runner.evaluate import evaluate_policies
    from kveval.runs.records import iter_items, read_run_info

    from cache_runs import specs_of
    from tiny_models import tiny_llama

    items = _items(context="the pass key is 42. " * 3, n=2) + _items(context="a b c d e f g h i j k " * 5, n=1)
    items[-1].id = "passkey-long"
    dirs = evaluate_policies(tiny_llama(), CharTok(), items, specs_of(["none", "threshold(scorer=keydiff,threshold=-0.2,window=4)"]),
                             tmp_path, "org/M")
    reached = [r.metrics["achieved_ratio"] for r in iter_items(dirs[1])]
    assert all(0 < r < 1 for r in reached) and len(set(reached)) > 1  # compressed, and by a different ratio per item
    assert [r.metrics["achieved_ratio"] for r in iter_items(dirs[0])] == [0.0] * 3  # none removes nothing
    info = read_run_info(dirs[1])
    assert info.ratio is None
    assert info.extra["achieved_ratio"] == {"mean": pytest.approx(sum(reached) / 3), "min": min(reached), "max": max(reached)}
    assert "achieved_ratio" not in read_run_info(dirs[0]).extra
    text = info.ratio_text
    assert text == f"~{sum(reached) / 3:.2f} [{min(reached):.2f}-{max(reached):.2f}]"
    assert text in to_markdown(*collect_rows(dirs, n_resamples=200))
    # the report plots the ratio each item reached; a report of fixed-ratio runs has no such plot
    from kveval.report.leaderboard import build_report

    plots = [p.name for p in build_report(dirs, tmp_path / "report", n_resamples=200)["plots"]]
    assert "achieved_ratio_org_M.png" in plots
    assert not any(p.name.startswith("achieved_ratio") for p in build_report(dirs[:1], tmp_path / "r0", n_resamples=200)["plots"])


def test_the_planner_sizes_a_threshold_at_its_achieved_ratio_only():
    from kveval.planner.memory import plan

    policy = parse_policy("threshold(scorer=knorm,threshold=-3)")
    with pytest.raises(PolicySpecError, match="plan it at a run's achieved ratio"):
        plan("smollm2-135m", 4096, policy=policy)
    assert plan("smollm2-135m", 4096, policy=policy, achieved_ratio=0.5).total_bytes == plan("smollm2-135m", 4096, policy=parse_policy("knorm(ratio=0.5)")).total_bytes


@pytest.mark.parametrize("spec", ["keydiff(ratio=0.5)", "lagkv(ratio=0.5,lag=4)", "cur(ratio=0.5)",
                                  "criticalkv(ratio=0.5,window=4)", "chunkkv(ratio=0.5,window=4,chunk=3)",
                                  "threshold(scorer=cur,threshold=0.02,window=4)", "expected_attention(ratio=0.5,future=8)"])
def test_a_batch_gives_the_answers_of_batch_size_one(spec):
    from cache_runs import assert_one_batch_equals_batch_size_one, random_prompts
    from tiny_models import Tok, tiny_llama

    assert_one_batch_equals_batch_size_one(tiny_llama(), Tok(), random_prompts([(30, 5), (41, 3), (25, 6)], 3), spec,
                                           max_new_tokens=4, kv_dtype="float32")


def test_one_shared_prefill_serves_the_presses_as_their_own_runs():
    from cache_runs import assert_shared_prefill_equals_own_runs, random_prompts
    from tiny_models import Tok, tiny_llama

    specs = ["snapkv(ratio=0.5,window=4)", "criticalkv(ratio=0.5,window=4)", "keydiff(ratio=0.5)", "cur(ratio=0.5)",
             "threshold(scorer=keydiff,threshold=-0.3,window=4)", "expected_attention(ratio=0.5,future=8)"]
    assert parse_policy(specs[-1]).prefills_alone and not parse_policy(specs[1]).prefills_alone
    assert_shared_prefill_equals_own_runs(tiny_llama(), Tok(), random_prompts([(30, 5), (41, 3)], 4), specs,
                                          max_new_tokens=3, kv_dtype="float32")
