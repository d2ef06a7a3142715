"""Head-adaptive budgets: AdaKV (``adaptive=true``) and DuoAttention-style retrieval heads (``duo``).

Heads of one layer keep different numbers of tokens, each in its own store:
the bytes measured are the tokens really held (never a mask over a full cache).
"""

import math

import pytest
import torch

import kveval.calibration.retrieval_heads as retrieval_heads
from kveval.cache.compressed import CompressedCache
from kveval.cache.decode_evictions import kept_slots
from kveval.errors import PolicySpecError
from kveval.policies.spec import parse_policy
from kveval.runner.generation import Prompt, generate
from kveval.stores.headwise import HeadwiseStore
from kveval.tensors.ranking import adaptive_choice, adaptive_choice_batch

from cache_runs import (
    assert_one_batch_equals_batch_size_one,
    assert_shared_prefill_equals_own_runs,
    context_then_steps,
    prefill,
    random_ids,
    random_prompts,
)
from tiny_models import Tok, tiny_gemma3, tiny_llama

ADAPTIVE = ["snapkv(ratio=0.5,window=4,adaptive=true)", "h2o(ratio=0.5,adaptive=true)", "knorm(ratio=0.5,adaptive=true)",
            "pyramidkv(ratio=0.5,window=4,adaptive=true)"]
DUO = "duo(heads=0.5,sink=2,window=8)"
#: K and V of one token in one KV head of tiny_llama (head_dim 16), stored in bfloat16.
HEAD_TOKEN_BYTES = 2 * 16 * 2

pytestmark = pytest.mark.usefixtures("calibration_cache")  # retrieval heads calibrate into each test's own folder


def _prompts(seed=3):
    return random_prompts([(47, 5), (80, 3), (30, 7)], seed)


def _prefill(model, spec):
    return prefill(model, spec, random_ids(80, 7))


# --- AdaKV ------------------------------------------------------------------------------------------
def test_adaptive_choice_moves_budget_to_the_head_that_scores_higher_with_the_floor_kept():
    scores = torch.stack([torch.linspace(1.0, 2.0, 20), torch.linspace(0.0, 0.5, 20)])
    chosen = adaptive_choice(scores, keep=10, floor=0.2)
    assert [c.numel() for c in chosen] == [18, 2]  # 20 in all; head 1 keeps floor(0.2 x 10) = 2, its best two
    assert torch.equal(chosen[1], torch.tensor([18, 19]))
    assert [c.numel() for c in adaptive_choice(scores, keep=10, floor=1.0)] == [10, 10]  # floor 1: even split
    padded = scores.clone()
    padded[1, :15] = float("-inf")  # head 1 holds 5 real tokens: padding is never kept
    assert sum(c.numel() for c in adaptive_choice(padded, keep=20, floor=0.2)) == 25


def _tied_rows(g, heads, lowest):
    """Four rows of ``[heads, n]`` scores with few distinct values (many ties, +inf as H2O scores its recent
    tokens), ``n`` from ``lowest`` up."""
    rows = []
    for _ in range(4):
        scores = torch.randint(0, 4, (heads, int(torch.randint(lowest, 30, (1,), generator=g))), generator=g).float()
        rows.append(scores.masked_fill(scores == 3, float("inf")))
    return rows


def test_adakv_ties_are_broken_alike_by_a_row_alone_and_in_a_padded_batch():
    """A decode eviction ranks equal scores in slot order on every path: a row chosen alone keeps what it keeps in
    a batch, where its heads end at the batch's last slot with padding (-inf) before them. With topk, which leaves
    the order of equal scores to the kernel, the two disagreed."""
    g = torch.Generator().manual_seed(5)
    for _ in range(100):
        keep, floor = int(torch.randint(1, 8, (1,), generator=g)), float(torch.rand(1, generator=g))
        rows = _tied_rows(g, 3, 9)
        width = max(r.shape[1] for r in rows) + 2
        batch = torch.full((len(rows), 3, width), float("-inf"))
        for b, scores in enumerate(rows):
            batch[b, :, width - scores.shape[1]:] = scores
        kept = adaptive_choice_batch(batch, keep, floor)
        for b, scores in enumerate(rows):
            alone = torch.zeros(scores.shape, dtype=torch.bool)
            for h, index in enumerate(adaptive_choice(scores, keep, floor, stable=True)):
                alone[h, index] = True
            assert torch.equal(kept[b, :, width - scores.shape[1]:], alone)
            assert not kept[b, :, :width - scores.shape[1]].any()


def test_adakv_few_drops_keep_what_the_ranking_keeps(monkeypatch):
    """A decode step appends a token to every head, so a row at AdaKV's budget comes back ``heads`` over: it drops
    its ``e`` lowest scores, found by one ``topk`` (``_adaptive_few_drops``), exactly as the ranking and each row
    alone (``adaptive_choice``) would. Rows within the budget keep every token. A tie at the boundary, a NaN, a
    guaranteed token among the lowest, or a row more than ``FEW_DROPS`` over goes to the ranking, which must then
    give the same."""
    from kveval.tensors import ranking as base

    g = torch.Generator().manual_seed(9)
    fast, ranked = [], []
    original = base._adaptive_few_drops

    def spied(*args):
        out = original(*args)
        (fast if out is not None else ranked).append(1)
        return out

    monkeypatch.setattr(base, "_adaptive_few_drops", spied)
    for trial in range(400):
        heads, keep, floor = 3, int(torch.randint(2, 7, (1,), generator=g)), float(torch.rand(1, generator=g)) * 0.6
        budget = keep * heads
        width = budget + 6
        batch = torch.full((4, heads, width), float("-inf"))
        rows = []
        # Over by up to heads + 2 (a decode step's heads, and more); in some trials the bound on drops is 2.
        monkeypatch.setattr(base, "FEW_DROPS", 2 if trial % 5 == 0 else 64)
        for b in range(4):
            total = budget + int(torch.randint(-2, heads + 3, (1,), generator=g))
            counts = [1] * heads
            for _ in range(total - heads):  # the rest at random, up to the width
                h = int(torch.randint(heads, (1,), generator=g))
                counts[h] = counts[h] + 1 if counts[h] < width else counts[h]
            scores = torch.full((heads, max(counts)), float("-inf"))
            for h, c in enumerate(counts):  # each head's tokens end at the row's last slot, as in the buffer
                values = (torch.randint(0, 6, (c,), generator=g).double() if trial % 3 == 0 else torch.rand(c, generator=g, dtype=torch.float64))
                values[-1] = float("inf")  # the newest token (and, with ties, H2O's +inf recent tokens)
                scores[h, max(counts) - c:] = values
            if trial % 11 == 0 and b == 1:
                scores[0, -2] = float("nan")
            batch[b, :, width - scores.shape[1]:] = scores
            rows.append(scores)
        kept = base.adaptive_choice_batch(batch, keep, floor)
        with monkeypatch.context() as patch:
            patch.setattr(base, "_adaptive_few_drops", lambda *args: None)
            assert torch.equal(kept, base.adaptive_choice_batch(batch, keep, floor))
        for b, scores in enumerate(rows):
            if scores.isnan().any():
                continue  # a NaN score: what the ranking does with it is the ranking's (the fast path left it)
            alone = torch.zeros(scores.shape, dtype=torch.bool)
            for h, index in enumerate(adaptive_choice(scores, keep, floor, stable=True)):
                alone[h, index] = True
            assert torch.equal(kept[b, :, width - scores.shape[1]:], alone)
    assert len(fast) > 100 and len(ranked) > 50  # both paths ran, many times


def test_adakv_decode_steps_drop_without_ranking(monkeypatch):
    """In a real AdaKV generation every row comes back over its budget by one token per head at each decode step:
    those steps drop by ``topk``, with no ranking (a tie would send a step to the ranking, which float attention
    mass almost never gives). The old single-drop check served none of them: it took only rows one token over."""
    from kveval.tensors import ranking as base

    model = tiny_llama()
    served = []
    original = base._adaptive_few_drops

    def spied(*args):
        out = original(*args)
        served.append(out is not None)
        return out

    monkeypatch.setattr(base, "_adaptive_few_drops", spied)
    prompts = random_prompts([(40, 3), (33, 5), (27, 2)], seed=4)
    generate(model, Tok(), prompts, parse_policy("h2o(budget=12,adaptive=true,decode_budget=10,recent=4)"), max_new_tokens=12)
    assert len(served) >= 20 and sum(served) >= 0.9 * len(served)


def test_decode_budget_ties_are_broken_alike_by_a_row_alone_and_in_a_padded_batch():
    """The same for one budget for every head: a row alone (``choose``) and the batch (``kept_slots``, each row's
    tokens first, padding after) keep the same slots among equal scores."""
    policy = parse_policy("h2o(ratio=0.5,decode_budget=4)").selection
    g = torch.Generator().manual_seed(6)
    for _ in range(100):
        rows = _tied_rows(g, 2, 4)
        budget = min(r.shape[1] for r in rows) - 1
        width = max(r.shape[1] for r in rows)
        batch = torch.full((len(rows), 2, width), float("-inf"))
        for b, scores in enumerate(rows):
            batch[b, :, :scores.shape[1]] = scores
        kept, _ = kept_slots(batch, budget, [r.shape[1] for r in rows])
        for b, scores in enumerate(rows):
            assert torch.equal(kept[b], policy.choose(scores, budget, None, stable=True))


@pytest.mark.parametrize("spec", ADAPTIVE)
def test_adaptive_with_ratio_zero_equals_none(spec):
    model = tiny_llama()
    prompts = [Prompt(list(range(1, 60)), [3, 4, 5])]
    zero = spec.replace("ratio=0.5", "ratio=0")
    ours, base = generate(model, Tok(), prompts, parse_policy(zero), max_new_tokens=8)[0], generate(model, Tok(), prompts, parse_policy("none"), max_new_tokens=8)[0]
    assert ours.token_ids == base.token_ids and ours.logprobs == base.logprobs
    assert ours.stats.kv_bytes == base.stats.kv_bytes


@pytest.mark.parametrize("spec", ADAPTIVE)
def test_adaptive_keeps_the_layer_budget_with_heads_apart_and_bytes_count_real_tokens(spec):
    model = tiny_llama()
    cache = _prefill(model, spec)
    policy = parse_policy(spec).selection
    uneven = False
    for i, layer in enumerate(cache.layers):
        row = layer.rows[0]
        lengths = row.store.head_lengths
        assert isinstance(row.store, HeadwiseStore)
        assert sum(lengths) == 2 * policy.keep_count(80, i, 2)  # the layer's budget: keep x kv_heads
        assert min(lengths) >= math.floor(0.2 * policy.keep_count(80, i, 2))  # AdaKV's safeguard
        uneven |= len(set(lengths)) > 1
        for h, n in enumerate(lengths):  # a head's real tokens are its last n slots, in order; the rest is padding
            real = row.positions[h, row.positions.shape[1] - n:]
            assert (real.diff() > 0).all() and (row.positions[h, :row.positions.shape[1] - n] == 2**62).all()
    # On this input the budget really moves between heads (H2O's mass from 80 near-uniform random-weight queries
    # decreases alike in both heads, so its split stays even here).
    assert uneven or spec.startswith("h2o")
    stats = cache.stats()
    held = sum(sum(layer.rows[0].store.head_lengths) for layer in cache.layers)
    assert stats.kv_bytes == held * HEAD_TOKEN_BYTES  # exact: sum over heads of kept tokens x bytes
    assert stats.index_bytes == held * 8 + (held * 4 if cache.layers[0].rows[0].attention is not None else 0)


def test_adaptive_stacks_with_kivi_and_quantizes_each_head_as_kivi_alone_does():
    model = tiny_llama()
    prompts = [Prompt(list(range(1, 60)), [3, 4, 5])]
    kivi = "kivi(bits=4,group=8,residual=4)"
    alone = generate(model, Tok(), prompts, parse_policy(kivi), max_new_tokens=8)[0]
    stacked = generate(model, Tok(), prompts, parse_policy(f"snapkv(ratio=0,window=4,adaptive=true)+{kivi}"), max_new_tokens=8)[0]
    assert (stacked.token_ids, stacked.logprobs, stacked.stats.kv_bytes) == (alone.token_ids, alone.logprobs, alone.stats.kv_bytes)
    dense = _prefill(model, "snapkv(ratio=0.5,window=4,adaptive=true)").stats().kv_bytes
    cache = _prefill(model, f"snapkv(ratio=0.5,window=4,adaptive=true)+{kivi}")
    expected = 0
    for layer in cache.layers:  # each head holds a kivi store of its own tokens only: its bytes follow its count
        for n in layer.rows[0].store.head_lengths:
            alone = cache.new_store(layer.layer_idx, torch.float32)
            alone.append(torch.randn(1, n, 16), torch.randn(1, n, 16))
            alone.seal()
            expected += alone.nbytes
    assert cache.stats().kv_bytes == expected < 0.6 * dense


@pytest.mark.parametrize("spec", ["h2o(ratio=0.5,adaptive=true,decode_budget=30)", "knorm(ratio=0.5,adaptive=true,decode_budget=30)"])
def test_adaptive_decode_budget_bounds_the_layer_while_generating(spec):
    model = tiny_llama()
    result = generate(model, Tok(), [Prompt(list(range(1, 61)))], parse_policy(spec), max_new_tokens=20)[0]
    assert len(result.token_ids) == 20
    assert result.stats.kv_bytes == 2 * 2 * 30 * HEAD_TOKEN_BYTES  # layers x heads x budget


def test_tova_adaptive_and_structure_stacks_are_refused():
    with pytest.raises(PolicySpecError, match="same for every head"):
        parse_policy("tova(ratio=0.5,adaptive=true)")
    with pytest.raises(PolicySpecError, match="quantization only"):
        parse_policy("snapkv(ratio=0.5,adaptive=true)+lowrank(rank=8)")
    with pytest.raises(PolicySpecError, match="floor"):
        parse_policy("snapkv(ratio=0.5,adaptive=true,floor=2)")
    assert parse_policy("snapkv(ratio=0.5,adaptive=true)").spec == "snapkv(ratio=0.5,adaptive=true)"


# --- DuoAttention-style retrieval heads -------------------------------------------------------------
def test_duo_extremes_equal_streaming_and_none():
    model = tiny_llama()
    prompts = _prompts()[:1]
    for duo, same in [("duo(heads=0,sink=2,window=8)", "streaming(sink=2,window=8)"), ("duo(heads=1,window=8)", "none"),
                      ("duo(heads=0,sink=2,ratio=0.5)", "streaming(sink=2,ratio=0.5)"), ("duo(heads=1,ratio=0.5)", "none")]:
        a, b = generate(model, Tok(), prompts, parse_policy(duo), max_new_tokens=12)[0], generate(model, Tok(), prompts, parse_policy(same), max_new_tokens=12)[0]
        assert (a.token_ids, a.logprobs, a.stats.kv_bytes, a.stats.kept_tokens) == (b.token_ids, b.logprobs, b.stats.kv_bytes, b.stats.kept_tokens)


def test_duo_keeping_every_token_leaves_the_models_own_mask():
    """A selection that keeps every token changes nothing, so the layer keeps the model's own causal mask. It used
    to switch to its own mask: equal in value, but on a CPU with AVX512-BF16 SDPA under an all-true mask gave
    logprobs 5e-7 away from no mask, so ``duo(heads=1)`` differed from ``none`` (the test above failed there)."""
    model = tiny_llama()
    _, cache = context_then_steps(model, "duo(heads=1,window=8)", random_ids(80, 7), random_ids(6, 8))
    assert all(layer.contiguous for layer in cache.layers)
    _, cache = context_then_steps(model, "duo(heads=0.5,window=8)", random_ids(80, 7), random_ids(6, 8))
    assert not any(layer.contiguous for layer in cache.layers)  # streaming heads drop tokens: its own mask


@pytest.mark.parametrize("scope", ["global", "layer"])
def test_duo_streaming_heads_stay_bounded_while_retrieval_heads_keep_everything(scope):
    model = tiny_llama()
    spec = f"duo(heads=0.5,sink=2,window=8,scope={scope})"
    mask = parse_policy(spec).selection.retrieval_mask(model, 2, 2)
    assert int(mask.sum()) == 2 and (scope == "global" or mask.sum(dim=1).tolist() == [1, 1])
    cache = CompressedCache(model, parse_policy(spec))
    with torch.no_grad():
        out = model(random_ids(60, 5), cache=cache)
        for step in range(15):
            out = model(out.logits[:, -1:].argmax(-1), cache=cache, position_ids=torch.tensor([[60 + step]]))
    for layer, retrieval in zip(cache.layers, mask):
        row = layer.rows[0]
        assert row.store.head_lengths == [75 if r else 10 for r in retrieval.tolist()]
        for h, r in enumerate(retrieval.tolist()):
            kept = row.positions[h][row.positions[h] != 2**62].tolist()
            assert kept == (list(range(75)) if r else [0, 1] + list(range(67, 75)))  # sinks + the 8 most recent
    held = sum(75 if r else 10 for r in mask.flatten().tolist())
    assert cache.stats().kv_bytes == held * HEAD_TOKEN_BYTES


@pytest.mark.parametrize("spec", [DUO, f"{DUO}+kivi(bits=4,group=8,residual=4)", "snapkv(ratio=0.5,window=4,adaptive=true)",
                                  "h2o(ratio=0.5,adaptive=true,decode_budget=30)",
                                  "snapkv(ratio=0.5,window=4,adaptive=true)+kivi(bits=4,group=8,residual=4)"])
@pytest.mark.parametrize("mode", ["context", "query"])
def test_batch_of_three_equals_batch_of_one(spec, mode):
    assert_one_batch_equals_batch_size_one(tiny_llama(), Tok(), _prompts(), spec, max_new_tokens=10, mode=mode)


@pytest.mark.parametrize("mode", ["context", "query"])
def test_shared_prefill_gives_the_items_of_separate_runs(mode):
    specs = ["snapkv(ratio=0.5,window=4,adaptive=true)", "snapkv(ratio=0.5,window=4)", DUO,
             "h2o(ratio=0.5,adaptive=true)+kivi(bits=4,group=8,residual=4)"]
    assert_shared_prefill_equals_own_runs(tiny_llama(), Tok(), _prompts(), specs, max_new_tokens=8, mode=mode, batch_size=2)


def test_retrieval_scores_are_cached_per_model_and_skip_sliding_layers(monkeypatch):
    model = tiny_gemma3()
    first = retrieval_heads.load_or_calibrate(model, 128)
    assert first.path.is_file()
    sliding = [layer.is_sliding for layer in CompressedCache(model, parse_policy("none")).layers]
    assert [bool(s) for s in first.scores.isnan().all(dim=1)] == sliding
    valid = first.scores[~first.scores.isnan()]
    assert ((valid >= 0) & (valid <= 1)).all() and valid.max() > 0
    retrieval_heads.clear_memory_cache()
    monkeypatch.setattr(retrieval_heads, "calibrate", lambda *a, **k: pytest.fail("calibrated again"))
    again = retrieval_heads.load_or_calibrate(model, 128)  # read back from disk
    assert torch.equal(torch.nan_to_num(again.scores, nan=-1), torch.nan_to_num(first.scores, nan=-1))
    mask = again.retrieval_mask(1.0, "global")
    assert mask.tolist() == [[not s] for s in sliding]  # sliding layers are never retrieval heads


def test_duo_on_gemma_sliding_layers_keep_their_window():
    model = tiny_gemma3()
    result = generate(model, Tok(), _prompts()[:1], parse_policy("duo(heads=0,sink=2,window=8)"), max_new_tokens=6)[0]
    reference = generate(model, Tok(), _prompts()[:1], parse_policy("streaming(sink=2,window=8)"), max_new_tokens=6)[0]
    assert (result.token_ids, result.stats.kv_bytes) == (reference.token_ids, reference.stats.kv_bytes)


def test_duo_parameters_are_validated():
    for spec, message in [("duo(heads=1.5)", "fraction"), ("duo(scope=model)", "scope"), ("duo(window=0)", "window"),
                          ("duo(calib_tokens=8)", "calib_tokens"), ("duo(window=8,ratio=0.5)", "not both"),
                          ("duo(ratio=1)", "out of range")]:
        with pytest.raises(PolicySpecError, match=message):
            parse_policy(spec)


def test_memory_planner_counts_retrieval_heads_whole_and_adakv_like_its_scorer():
    from kveval.planner.memory import plan

    config = {"model_type": "llama", "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4,
              "hidden_size": 512, "intermediate_size": 1024, "vocab_size": 1000}
    duo = plan(config, 4000, policy=parse_policy("duo(heads=0.25,sink=4,window=60)"), new_tokens=100)
    # per KV head on average: a quarter keep 4100 tokens, the rest 64
    assert [layer.tokens for layer in duo.layers] == [math.ceil(0.25 * 4100 + 0.75 * 64)] * 4
    assert plan(config, 4000, policy=parse_policy("snapkv(ratio=0.5,adaptive=true)")).sequence_bytes == \
        plan(config, 4000, policy=parse_policy("snapkv(ratio=0.5)")).sequence_bytes
