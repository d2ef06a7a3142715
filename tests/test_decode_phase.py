"""Decode-phase compression for long outputs: ``decode_interval`` (kvpress's DecodingPress), R-KV, and the peak
decode bytes each item records."""

import math

import pytest
import torch

from kveval.cache.compressed import CompressedCache
from kveval.errors import PolicySpecError
from kveval.policies.rkv import RKVPolicy, key_redundancy
from kveval.policies.spec import parse_policy
from kveval.runner.generation import Prompt, generate, generate_many
from kveval.tensors.scoring_state import ScoringState

from tiny_models import Tok, tiny_llama

#: K and V bytes per token of tiny_llama in bfloat16: 2 layers x 2 KV heads x 16 wide x (K, V) x 2 bytes.
TOKEN_BYTES = 2 * 2 * 16 * 2 * 2


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def _prompts(seed=10, shapes=((37, 5), (64, 3), (20, 7))):
    g = torch.Generator().manual_seed(seed)
    return [Prompt(torch.randint(1, 128, (n,), generator=g).tolist(), torch.randint(1, 128, (q,), generator=g).tolist())
            for n, q in shapes]


def test_decode_interval_parses_and_refuses_what_means_nothing():
    assert parse_policy("knorm(ratio=0.5,decode_budget=20,decode_interval=1)").spec == "knorm(ratio=0.5,decode_budget=20)"
    stack = parse_policy("knorm(ratio=0.5,decode_budget=20,decode_interval=16)")
    assert stack.spec == "knorm(ratio=0.5,decode_budget=20,decode_interval=16)"
    assert stack.selection.decode_limit == 35
    assert parse_policy("knorm(ratio=0.5,decode_budget=20)").selection.decode_limit == 20
    assert parse_policy("knorm(ratio=0.5)").selection.decode_limit is None
    for bad in ("knorm(ratio=0.5,decode_interval=4)", "knorm(ratio=0.5,decode_budget=20,decode_interval=0)",
                "snapkv(ratio=0.5,decode_budget=20,decode_interval=4)", "rkv(ratio=0,decode_budget=8,window=8)",
                "knorm(ratio=0.5,adaptive=true,decode_budget=20,decode_interval=4)",
                "rkv(ratio=0,decode_budget=20,adaptive=true)", "rkv(ratio=0,decode_budget=20,kernel=2)"):
        with pytest.raises(PolicySpecError):
            parse_policy(bad)


def test_interval_one_is_the_plain_decode_budget(model):
    prompts = _prompts()
    plain = generate(model, Tok(), prompts, parse_policy("h2o(ratio=0.5,decode_budget=20)"), max_new_tokens=20,
                     batch_size=3)
    given = generate(model, Tok(), prompts, parse_policy("h2o(ratio=0.5,decode_budget=20,decode_interval=1)"),
                     max_new_tokens=20, batch_size=3)
    assert [r.token_ids for r in plain] == [r.token_ids for r in given]
    assert [r.logprobs for r in plain] == [r.logprobs for r in given]
    assert [r.stats.kept_tokens for r in plain] == [r.stats.kept_tokens for r in given]


@pytest.mark.parametrize("spec", ["knorm(ratio=0,decode_budget=20,decode_interval=4)",
                                  "rkv(ratio=0,decode_budget=20,decode_interval=4,window=4)"])
def test_the_cache_grows_for_interval_steps_then_is_compressed_to_the_budget(model, spec):
    """A 16-token prompt, then one token per step: the cache holds 16, 17, ... 23 tokens, then every 4 steps it is
    compressed back to 20 (budget + interval = 24 after a step's attention), so between steps it holds
    20, 21, 22, 23, 20, ... and never more than decode_limit = 23."""
    cache = CompressedCache(model, parse_policy(spec))
    ids = torch.randint(1, 128, (1, 16), generator=torch.Generator().manual_seed(3))
    held = []
    with torch.no_grad():
        out = model(ids, cache=cache, position_ids=torch.arange(16)[None])
        for step in range(16):
            nxt = out.logits[:, -1:].argmax(-1)
            out = model(nxt, cache=cache, position_ids=torch.tensor([[16 + step]]))
            held.append(cache.layers[0].rows[0].store.length)
    assert held == [17, 18, 19, 20, 21, 22, 23, 20, 21, 22, 23, 20, 21, 22, 23, 20]
    row = cache.layers[0].rows[0]
    if spec.startswith("rkv"):  # the last window queries kept, the newest last
        assert row.queries.shape[1] == 4 and row.query_positions.tolist() == [28, 29, 30, 31]
    # The newest token always stays; positions stay in order.
    assert int(row.positions[0, -1]) == 31 and bool((row.positions[:, 1:] > row.positions[:, :-1]).all())


@pytest.mark.parametrize("spec", ["knorm(ratio=0.5,decode_budget=20,decode_interval=8)",
                                  "h2o(ratio=0.5,decode_budget=20,decode_interval=8)",
                                  "rkv(ratio=0.5,decode_budget=20,decode_interval=8,window=4)"])
@pytest.mark.parametrize("mode", ["context", "query"])
def test_batch_of_three_equals_batch_of_one(model, spec, mode):
    """Rows of 24, 35 and 17 tokens after the prompt (context mode) reach 27 at different steps: each is compressed
    when it alone reaches decode_budget + decode_interval, as by itself."""
    prompts = _prompts()
    one = generate(model, Tok(), prompts, parse_policy(spec), max_new_tokens=16, mode=mode, batch_size=1)
    three = generate(model, Tok(), prompts, parse_policy(spec), max_new_tokens=16, mode=mode, batch_size=3)
    assert [r.token_ids for r in one] == [r.token_ids for r in three]
    assert [r.stats.kv_bytes for r in one] == [r.stats.kv_bytes for r in three]
    assert [r.peak_kv_bytes for r in one] == [r.peak_kv_bytes for r in three]


def test_a_shared_prefill_gives_each_decode_phase_policy_its_own_answers(model):
    """What a sweep runs (one prefill for every policy of a batch, each derived from it): the same tokens and peak
    bytes as each policy alone."""
    specs = ["none", "knorm(ratio=0,decode_budget=20,decode_interval=4)",
             "rkv(ratio=0,decode_budget=20,decode_interval=4,window=4)"]
    prompts = _prompts()
    many = generate_many(model, Tok(), prompts, [parse_policy(s) for s in specs], max_new_tokens=16, batch_size=3)
    for spec in specs:
        alone = generate(model, Tok(), prompts, parse_policy(spec), max_new_tokens=16, batch_size=1)
        together = many[parse_policy(spec).spec]
        assert [r.token_ids for r in together] == [r.token_ids for r in alone], spec
        assert [r.peak_kv_bytes for r in together] == [r.peak_kv_bytes for r in alone], spec
    assert [r.peak_kv_bytes for r in many["rkv(ratio=0,decode_budget=20,decode_interval=4,window=4)"]] == \
        [23 * TOKEN_BYTES] * 3


@pytest.mark.parametrize("spec, limit", [("knorm(ratio=0.5,decode_budget=20)", 20),
                                         ("knorm(ratio=0.5,decode_budget=20,decode_interval=8)", 27),
                                         ("rkv(ratio=0.5,decode_budget=20,decode_interval=6,window=4)", 25)])
def test_peak_decode_bytes_stay_within_the_budget_and_its_interval(model, spec, limit):
    """Context mode: the prompt's context is halved (at most 32 tokens + the question), so from the first eviction
    on a row holds at most decode_limit tokens between steps; its peak is reached, and is at least its final bytes."""
    results = generate(model, Tok(), _prompts(), parse_policy(spec), max_new_tokens=30, batch_size=3)
    for r in results:
        assert len(r.token_ids) == 30
        assert r.peak_kv_bytes >= r.stats.kv_bytes
        assert r.peak_kv_bytes == limit * TOKEN_BYTES


@pytest.mark.parametrize("spec", ["none", "snapkv(ratio=0.5)"])
def test_bytes_that_only_grow_peak_at_the_end(model, spec):
    for r in generate(model, Tok(), _prompts(), parse_policy(spec), max_new_tokens=12, batch_size=3):
        assert r.peak_kv_bytes == r.stats.kv_bytes > 0


def test_a_prompt_over_the_budget_peaks_before_its_first_step(model):
    """Query-aware: the whole prompt (question included, never evicted at the prefill) is held until the first
    decode step cuts it to the budget: the peak is the prompt's bytes (32 + 3 of its 64 + 3 tokens kept)."""
    prompts = _prompts(shapes=((64, 3),))
    (r,) = generate(model, Tok(), prompts, parse_policy("knorm(ratio=0.5,decode_budget=20)"), max_new_tokens=8,
                    mode="query")
    assert r.stats.kv_bytes == 20 * TOKEN_BYTES and r.peak_kv_bytes == 35 * TOKEN_BYTES


def test_rkv_scores_a_hand_computed_case():
    """One KV head read by two query heads, four tokens of width 2, a window of 1 (token 3 always kept).

    Keys (1,0), (2,0), (0,1), (1,1). Cosine similarities (diagonal 0): rows [0,1,0,r], [1,0,0,r], [0,0,0,r],
    [r,r,r,0] with r = 1/sqrt(2). Above 0.5, each key's most recent neighbour is spared: key 0's, 1's and 2's is
    key 3, key 3's is key 2. Left: [0,1,0,0], [1,0,0,0], [0,0,0,0], [r,r,0,0]; column means (1+r)/4, (1+r)/4, 0,
    0; softmax of those is the redundancy.

    Queries (0,2) and (0,-2): logits q.k/sqrt(2), max over the two heads: [0, 0, sqrt(2), sqrt(2)]; softmax over
    the tokens before the window (0, 1, 2): e^0, e^0, e^sqrt(2) normalized, the importance.
    """
    keys = torch.tensor([[[1.0, 0.0], [2.0, 0.0], [0.0, 1.0], [1.0, 1.0]]])
    queries = torch.tensor([[[0.0, 2.0]], [[0.0, -2.0]]])  # [query heads, 1 query, 2]
    state = ScoringState(keys=keys, positions=torch.arange(4)[None], attention=None, layer_idx=0, num_layers=1,
                         queries=queries, query_positions=torch.tensor([3]))
    policy = RKVPolicy(ratio=0.0, window=1, kernel=1, mix=0.5)
    scores = policy.scores(state)[0]

    r = 1 / math.sqrt(2)
    mean = (1 + r) / 4
    norm = 2 * math.exp(mean) + 2
    redundancy = [math.exp(mean) / norm, math.exp(mean) / norm, 1 / norm, 1 / norm]
    e = math.exp(math.sqrt(2))
    importance = [1 / (2 + e), 1 / (2 + e), e / (2 + e)]
    expected = [0.5 * importance[i] - 0.5 * redundancy[i] for i in range(3)]
    assert torch.allclose(scores[:3], torch.tensor(expected), atol=1e-6)
    assert scores[3] == float("inf")
    assert torch.allclose(key_redundancy(keys, 0.5)[0], torch.tensor(redundancy), atol=1e-6)


def test_rkv_pools_importance_over_neighbours_and_spares_nothing_without_a_similar_key():
    """Orthogonal keys: no similarity at all, redundancy uniform (1/4). One query sees token 1 alone (logit 10 vs
    0): importance [~0, ~1, ~0]; max-pooled over 3 slots it is ~1 at tokens 0, 1 and 2."""
    keys = torch.eye(4)[None]  # 4 orthogonal keys of width 4
    assert torch.equal(key_redundancy(keys, 0.5), torch.full((1, 4), 0.25))
    queries = torch.tensor([[[0.0, 20.0, 0.0, 0.0]]])  # logits 20 / sqrt(4) = 10 on token 1
    state = ScoringState(keys=keys, positions=torch.arange(4)[None], attention=None, layer_idx=0, num_layers=1,
                         queries=queries, query_positions=torch.tensor([3]))
    pooled = RKVPolicy(ratio=0.0, window=1, kernel=3, mix=1.0).scores(state)[0]
    top = math.exp(10) / (math.exp(10) + 2)
    assert torch.allclose(pooled[:3], torch.tensor([top, top, top]), atol=1e-6)
