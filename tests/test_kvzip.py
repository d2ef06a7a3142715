"""KVzip (kveval.policies.kvzip, kveval.cache.reconstruction): its score on hand-computed cases, the reconstruction
pass against the model's own eager attention, batches, the architecture matrix, the ratio's direction and refusals."""

import math

import pytest
import torch

from kveval.cache.compressed import CompressedCache
from kveval.cache.reconstruction import FIRST_PROMPT, LATER_PROMPT, ReconstructionObserver, chat_split, repeat_inputs
from kveval.errors import PolicySpecError, UnsupportedModelError, UsageError
from kveval.modeling.architectures import mla_dims
from kveval.policies.base import PolicyStack
from kveval.policies.kvzip import kvzip_keep, reconstruction_scores
from kveval.policies.spec import parse_policy
from kveval.runner.generation import Prompt, generate, prefill_prompts, reconstruct_and_compress

from cache_runs import assert_one_batch_equals_batch_size_one, assert_one_line_error, random_prompts
from tiny_models import ARCHITECTURES, Tok, tiny_llama, tiny_model

F32 = torch.float32


def test_the_score_is_the_largest_probability_over_queries_and_group_in_the_restricted_softmax():
    # One KV head read by two query heads, d = 1, scaling 1. Keys: a sink (0), the chunk (ln 2, 0), two
    # reconstruction tokens (0, 0). Head 0's queries are 1: logits 0, ln 2, 0 | 0, 0 (the second query alone sees
    # the last key): probabilities 1/5, 2/5, 1/5, 1/5 then 1/6, 2/6, 1/6, 1/6, 1/6. Head 1's queries are 0:
    # uniform over the 4 then the 5 keys each sees. Chunk token 0: max(2/5, 2/6, 1/4, 1/5) = 2/5;
    # chunk token 1: max(1/5, 1/6, 1/4, 1/5) = 1/4.
    query = torch.tensor([[[1.0], [1.0]], [[0.0], [0.0]]])  # [heads 2, q 2, d 1]
    keys = torch.tensor([[[0.0], [math.log(2)], [0.0], [0.0], [0.0]]])  # [kv_heads 1, 1 + 2 + 2, 1]
    scores = reconstruction_scores(query, keys, 1.0, torch.tensor([1, 2]))
    torch.testing.assert_close(scores, torch.tensor([[2 / 5, 1 / 4]]))


def test_the_budget_is_one_bottom_k_over_every_layer_or_one_per_layer():
    # Position 0 is a sink: it scores max + 1 = 1.9 in both layers. ratio 0.5 of 8 slots: the 4 lowest go.
    scores = [torch.tensor([[0.1, 0.5, 0.2, 0.9]]), torch.tensor([[0.3, 0.05, 0.06, 0.04]])]
    positions = [torch.arange(4)[None], torch.arange(4)[None]]
    overall = kvzip_keep(scores, positions, 0.5, 1, layerwise=False)  # .04, .05, .06, .2 go
    assert [k.tolist() for k in overall] == [[[True, True, False, True]], [[True, False, False, False]]]
    per_layer = kvzip_keep(scores, positions, 0.5, 1, layerwise=True)  # 2 per layer: .2, .5 and .04, .05
    assert [k.tolist() for k in per_layer] == [[[True, False, False, True]], [[True, False, True, False]]]
    # int(ratio x slots) go: 0.3 of 8 is 2 (.04 and .05)
    assert sum(int((~k).sum()) for k in kvzip_keep(scores, positions, 0.3, 1, layerwise=False)) == 2
    # without sinks a head may lose every slot: it keeps its best one (kvpress would mask all its context keys)
    lonely = kvzip_keep([torch.tensor([[0.9, 0.8], [0.1, 0.2]])], [torch.arange(2)[None].expand(2, 2)], 0.5, 0, False)
    assert lonely[0].tolist() == [[True, True], [False, True]]


def test_the_reconstruction_prompt_repeats_each_chunk_after_the_template_head():
    context = list(range(100, 125))  # 25 tokens: a 3-token template head, then chunks of 10, 10 and 2
    first, later, suffix = [1, 2], [3], [9]
    chunks = repeat_inputs(context, 3, suffix, 10, first, later)
    assert [(s, e) for s, e, _ in chunks] == [(3, 13), (13, 23), (23, 25)]
    assert chunks[0][2] == first + suffix + context[3:13]
    assert chunks[1][2] == later + context[5:13] + suffix + context[13:23]  # the previous chunk's last 8
    assert chunks[2][2] == later + context[15:23] + suffix + context[23:25]
    assert repeat_inputs(context, 3, suffix, 4, first, later)[1][2][:5] == later + context[3:7]  # a chunk under 8
    assert repeat_inputs(context[:3], 3, suffix, 10, first, later) == []  # nothing after the head: nothing scored
    assert chat_split(Tok()) == (0, [3 + ord("\n") % 120])  # no template: no head, "\n" as the assistant turn


def _reference_scores(model, context, chunks, sink):
    """KVzip's scores from the model's own eager attention: each reconstruction as one forward over context +
    reconstruction ids (the same causal attention as over the cache), the probabilities of the reconstruction's
    queries renormalised over the sinks, the chunk and the reconstruction tokens (the restricted softmax)."""
    n = len(context)
    config = model.config
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    out = {}
    for start, end, ids in chunks:
        with torch.no_grad():
            attentions = model(torch.tensor([context + ids]), output_attentions=True).attentions
        columns = list(range(min(sink, start))) + list(range(start, end)) + list(range(n, n + len(ids)))
        for layer, a in enumerate(attentions):
            p = a[0, :, n:, columns].double()
            p = p / p.sum(-1, keepdim=True)
            chunk = p[..., min(sink, start):min(sink, start) + end - start]
            best = chunk.reshape(kv_heads, heads // kv_heads, len(ids), -1).amax(dim=(1, 2))
            out.setdefault(layer, torch.zeros(kv_heads, n, dtype=torch.float64))[:, start:end] = best
    return out


@pytest.mark.parametrize("chunk", [2048, 16])
def test_the_reconstruction_pass_scores_as_the_model_s_own_attention_and_keeps_its_top_k(chunk):
    model, eager = tiny_llama(), tiny_llama(attn="eager")
    context = torch.randint(3, 128, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    policy = parse_policy(f"kvzip(ratio=0.6,chunk={chunk})")
    tok = Tok()
    head, suffix = chat_split(tok)
    first, later = tok(FIRST_PROMPT)["input_ids"], tok(LATER_PROMPT)["input_ids"]
    chunks = repeat_inputs(context, head, suffix, chunk, first, later)
    assert len(chunks) == (1 if chunk > 40 else 3)
    reference = _reference_scores(eager, context, chunks, 4)

    seen = {}

    class Recording(ReconstructionObserver):
        def __call__(self, layer, query, keys, scaling):
            super().__call__(layer, query, keys, scaling)
            seen.update(self.scores)

    import kveval.cache.reconstruction as reconstruction

    cache = CompressedCache(model, policy, kv_dtype=F32)
    with torch.no_grad():
        prefill_prompts(model, cache, [Prompt(context)], "context", 0)
        original, reconstruction.ReconstructionObserver = reconstruction.ReconstructionObserver, Recording
        try:
            reconstruct_and_compress(model, tok, cache, [context], 0)
        finally:
            reconstruction.ReconstructionObserver = original
    for layer in reference:
        torch.testing.assert_close(seen[layer].double(), reference[layer], atol=1e-6, rtol=1e-5)
    expected = kvzip_keep([reference[i].float() for i in sorted(reference)], [torch.arange(40)[None].expand(2, 40)] * 2,
                          0.6, 4, layerwise=False)
    for layer, keep in zip(cache.attention_layers, expected):
        held = [sorted(int(p) for p in head if 0 <= p < 40) for head in layer.rows[0].positions]
        assert held == [head.nonzero().flatten().tolist() for head in keep]
    assert sum(int(k.sum()) for k in expected) == 2 * 2 * 40 - int(2 * 2 * 40 * 0.6)  # the ratio, over all layers
    assert all(set(range(4)) <= set(head) for layer in cache.attention_layers
               for head in ([int(p) for p in h] for h in layer.rows[0].positions))  # sinks stay


@pytest.mark.parametrize("spec", ["kvzip(ratio=0.5)", "kvzip(ratio=0.5,layerwise=true,chunk=8)",
                                  "kvzip(ratio=0.5)+kivi(bits=4,group=16,residual=8)"])
def test_a_batch_gives_the_answers_bytes_and_kept_sets_of_batch_size_one(spec):
    model = tiny_llama()
    prompts = random_prompts([(30, 5), (41, 3), (25, 6)], 3)
    assert_one_batch_equals_batch_size_one(model, Tok(), prompts, spec, max_new_tokens=4, kv_dtype="float32")

    def kept(batch):
        cache = CompressedCache(model, parse_policy(spec), kv_dtype=F32)
        with torch.no_grad():
            prefill_prompts(model, cache, batch, "context", 0)
            reconstruct_and_compress(model, Tok(), cache, [p.context for p in batch], 0)
        return [[[sorted(int(p) for p in head if 0 <= p < 1000) for head in layer.rows[b].positions]
                 for layer in cache.attention_layers] for b in range(len(batch))]

    assert kept(prompts) == [kept([p])[0] for p in prompts]


def test_more_compression_holds_fewer_bytes_and_the_kept_share_is_the_ratio_over_all_layers():
    model = tiny_llama()
    prompts = random_prompts([(60, 4)], 5)
    results = {r: generate(model, Tok(), prompts, parse_policy(f"kvzip(ratio={r})"), max_new_tokens=2,
                           kv_dtype=F32)[0] for r in (0.25, 0.5, 0.75)}
    bytes_ = [results[r].stats.kv_bytes for r in (0.25, 0.5, 0.75)]
    assert bytes_[0] > bytes_[1] > bytes_[2] > 0
    assert all(results[r].stats.kv_bytes < results[r].stats.nominal_bytes for r in results)
    # the context's kept share over layers and heads is the ratio's (60 tokens x 2 layers x 2 heads, then 4 + 1 more)
    for r, result in results.items():
        context_kept = sum(k[0] for k in result.stats.kept_tokens) * 2 - 2 * 2 * 5
        assert context_kept == 240 - int(240 * r)


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_kvzip_runs_on_the_architecture_matrix_below_nominal_bytes(name):
    model = tiny_model(name)
    prompts = [Prompt(torch.randint(3, 128, (64,), generator=torch.Generator().manual_seed(1)).tolist(), [5, 6, 7])]
    spec = parse_policy("kvzip(ratio=0.5,chunk=24)")
    if mla_dims(model.config) is not None:
        assert_one_line_error(lambda: generate(model, Tok(), prompts, spec, max_new_tokens=2), UnsupportedModelError,
                              "caches an MLA latent")
        return
    result = generate(model, Tok(), prompts, spec, max_new_tokens=2)[0]
    assert len(result.token_ids) == 2
    assert 0 < result.stats.kv_bytes < result.stats.nominal_bytes


@pytest.mark.parametrize("spec, message", [
    ("kvzip", "give ratio="),
    ("kvzip(ratio=1.0)", "ratio=1.0 is out of range"),
    ("kvzip(ratio=0.5,chunk=0)", "chunk=0 must be a positive"),
    ("kvzip(ratio=0.5,sink=-1)", "sink=-1 must be"),
    ("kvzip(ratio=0.5,decode_budget=8)", "has no parameter 'decode_budget'"),
    ("kvzip(ratio=0.5)+lowrank(rank=8)", "keeps a different number of tokens per head"),
])
def test_spec_errors_are_one_line(spec, message):
    assert_one_line_error(lambda: parse_policy(spec), PolicySpecError, message)


def test_query_mode_mla_and_forwards_without_the_reconstruction_are_refused_in_one_line():
    from kveval.runner.runspec import RunSpec

    assert_one_line_error(lambda: RunSpec.parse("kvzip(ratio=0.5)", mode="query"), UsageError, "mode 'context'")
    assert_one_line_error(lambda: RunSpec.parse("kvzip(ratio=0.5)@query"), UsageError, "mode 'context'")
    model = tiny_llama()
    prompts = random_prompts([(20, 2)], 1)
    assert_one_line_error(lambda: generate(model, Tok(), prompts, parse_policy("kvzip(ratio=0.5)"), mode="query"),
                          UsageError, "mode 'context'")
    deepseek = tiny_model("deepseek_v3") if "deepseek_v3" in ARCHITECTURES else None
    if deepseek is not None:  # before any weights load, from the config alone
        assert_one_line_error(lambda: RunSpec.parse("kvzip(ratio=0.5)").for_model(deepseek.config),
                              UnsupportedModelError, "caches an MLA latent")
    cache = CompressedCache(model, parse_policy("kvzip(ratio=0.5)"))
    ids = torch.tensor([prompts[0].context])
    with torch.no_grad():
        model(ids, cache=cache, use_cache=True)
        assert_one_line_error(lambda: model(ids[:, :1], cache=cache, use_cache=True), UsageError,
                              "before KVzip's reconstruction pass")


def test_the_lm_eval_adapter_refuses_kvzip_before_anything_loads():
    pytest.importorskip("lm_eval")
    from kveval.lm_eval.model import KVEvalLM

    assert_one_line_error(lambda: KVEvalLM(pretrained="no-such-model", policy="kvzip(ratio=0.5)"), UsageError,
                          "lm-eval adapter does not run")


def test_kvzip_is_listed_and_prefills_alone():
    from kveval.policies.registry import POLICIES

    assert "kvzip" in POLICIES
    stack = parse_policy("kvzip(ratio=0.5)")
    assert stack.prefills_alone and stack.ratio == 0.5 and stack.spec == "kvzip(ratio=0.5)"
    assert not PolicyStack().prefills_alone


def test_the_planner_sizes_kvzip_at_its_ratio_over_all_layers():
    from kveval.planner.memory import plan

    half = plan("smollm2-135m", 4096, policy=parse_policy("kvzip(ratio=0.5)")).total_bytes
    assert half == plan("smollm2-135m", 4096, policy=parse_policy("knorm(ratio=0.5)")).total_bytes
    assert half < plan("smollm2-135m", 4096, policy=parse_policy("kvzip(ratio=0.25)")).total_bytes
