"""Batched greedy generation against plain transformers, token for token, with left padding and EOS.

The throughput benchmark once showed kveval ``none`` at batch 32 giving other
tokens than transformers ``generate`` at batch 32. Neither side depends on the
batch: the difference was the cache dtype. kveval stores full-precision tokens
in the deployment's ``kv_dtype`` (bfloat16 for SmolLM2) while transformers keeps
the float32 it computes in, and one of the 32 prompts (none of the first 8)
flips a token at step 12 under that rounding, at batch 1 as at batch 32. With
``kv_dtype`` equal to the compute dtype every row agrees. These tests pin that
down on tiny models: prompts of mixed lengths (so batches are left-padded) and
an EOS id that ends rows at different steps.
"""

import pytest
import torch

from kveval.policies.spec import parse_policy
from kveval.runner.generation import Prompt, generate, generate_each

from tiny_models import Tok, tiny_gemma3, tiny_llama

STEPS = 12


def _prompts(n=12, seed=3):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, 80, (n,), generator=g).tolist()
    return [Prompt(torch.randint(3, 128, (k,), generator=g).tolist(), torch.randint(3, 128, (3,), generator=g).tolist())
            for k in lengths]


def _hf_generate(model, prompts, eos):
    """transformers ``generate`` (DynamicCache) on left-padded ``prompts``; each row's ids before its first EOS."""
    rows = [p.context + p.question for p in prompts]
    width = max(map(len, rows))
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        ids[b, width - len(row):] = torch.tensor(row)
        mask[b, width - len(row):] = 1
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=STEPS, do_sample=False,
                             pad_token_id=0, eos_token_id=eos)
    new = [row.tolist() for row in out[:, width:]]
    return [row[:row.index(eos)] if eos in row else row for row in new]


def _kveval(model, prompts, batch_size, kv_dtype):
    return [r.token_ids for r in generate(model, Tok(), prompts, parse_policy("none"), max_new_tokens=STEPS, batch_size=batch_size,
                                          kv_dtype=kv_dtype)]


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
def test_batch_n_equals_batch_1_equals_transformers_batch_1(make):
    model = make()
    prompts = _prompts()
    assert len({p.length for p in prompts}) > 6  # mixed lengths: every batch is left-padded
    free = _kveval(model, prompts, 1, model.dtype)
    # An EOS id that ends at least two rows early, at different steps, and leaves others running to STEPS.
    eos = next(t for t in sorted({t for row in free for t in row[1:]})
               if len({row.index(t) for row in free if t in row}) >= 2 and sum(t in row for row in free) < len(free))
    model.generation_config.eos_token_id = eos

    hf_one = [_hf_generate(model, [p], eos)[0] for p in prompts]
    assert len({len(row) for row in hf_one}) >= 3  # rows stop at different steps, some run to the end
    assert max(map(len, hf_one)) == STEPS
    for size in (1, 5, len(prompts)):
        # kv_dtype equal to the compute dtype: the cache holds what transformers' DynamicCache holds.
        assert _kveval(model, prompts, size, model.dtype) == hf_one, size
    # Plain transformers does not depend on the batch here either.
    assert _hf_generate(model, prompts, eos) == hf_one
    # The deployment dtype (bfloat16 storage) changes the arithmetic, never the batch independence.
    rounded = _kveval(model, prompts, 1, None)
    assert _kveval(model, prompts, len(prompts), None) == rounded


@pytest.mark.parametrize("spec", ["none", "h2o(ratio=0.5,decode_budget=24)"])
def test_llama4_query_temperature_counts_each_rows_own_positions(spec):
    """Llama 4's layers without RoPE scale their queries by ``1 + attn_scale * log1p(floor((position + 1) /
    floor_scale))`` (temperature tuning), the position taken by transformers from the cache's length: in a
    left-padded batch, padding included. Every 8,192 positions in a real Llama 4 the scale steps, so a row padded
    across a step was scaled as another row would be, and batch N gave other answers than batch 1 (at 8k to 128k
    tokens, where users evaluate). Here the step comes every 16 positions, so every batch crosses some; kveval
    scales each row's queries by its own positions: batch N equals batch 1 equals transformers' batch 1."""
    from tiny_models import tiny_model

    model = tiny_model("llama4", attn_temperature_tuning=True, floor_scale=16, attn_scale=0.5)
    assert any(not layer.self_attn.use_rope for layer in model.model.layers)  # a NoPE layer, tuned
    with torch.no_grad():  # sharper attention than random weights give, so that the queries' scale shows in tokens
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(16)
            layer.self_attn.k_proj.weight.mul_(16)
    prompts = _prompts()
    hf_one = [_hf_generate(model, [p], None)[0] for p in prompts]
    one = [r.token_ids for r in generate(model, Tok(), prompts, parse_policy(spec), max_new_tokens=STEPS, batch_size=1,
                                         kv_dtype=model.dtype)]
    if spec == "none":
        assert one == hf_one
    for size in (5, len(prompts)):
        assert [r.token_ids for r in generate(model, Tok(), prompts, parse_policy(spec), max_new_tokens=STEPS, batch_size=size,
                                              kv_dtype=model.dtype)] == one, size
    # The padding counted matters here: transformers' own batch gives other tokens (its scale counts padding).
    assert _hf_generate(model, prompts, None) != hf_one
    # The modules scale their own queries again outside kveval's forwards: transformers alone gives what it gave.
    assert [_hf_generate(model, [p], None)[0] for p in prompts] == hf_one


def test_llama4_query_temperature_is_given_back_after_a_failed_forward():
    from kveval.modeling.architectures import row_query_temperatures, taken_query_temperature

    from tiny_models import tiny_model

    model = tiny_model("llama4")
    tuned = [layer.self_attn for layer in model.model.layers if not layer.self_attn.use_rope]
    assert tuned and all(module.attn_temperature_tuning for module in tuned)
    with pytest.raises(ZeroDivisionError):
        with row_query_temperatures(model):
            assert not any(module.attn_temperature_tuning for module in tuned)
            assert taken_query_temperature(tuned[0]).floor_scale == model.config.floor_scale
            1 / 0
    assert all(module.attn_temperature_tuning for module in tuned) and taken_query_temperature(tuned[0]) is None
    # A model whose attention is not kveval's keeps its own scaling: nothing would apply it again.
    sdpa = tiny_model("llama4", attn="sdpa")
    with row_query_temperatures(sdpa):
        assert all(layer.self_attn.attn_temperature_tuning for layer in sdpa.model.layers if not layer.self_attn.use_rope)


def _longrope_phi3():
    """Phi-3's longrope, switching to its long factors once a forward passes 64 positions (3x slower angles)."""
    from tiny_models import tiny_model

    model = tiny_model("phi3", hidden_size=128, max_position_embeddings=256, original_max_position_embeddings=64,
                       rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": [1.0] * 16,
                                        "long_factor": [3.0] * 16, "original_max_position_embeddings": 64})
    with torch.no_grad():  # sharper attention than random weights give, so that the angles show in tokens
        for layer in model.model.layers:
            layer.self_attn.qkv_proj.weight.mul_(8)
    return model


def _prompts_of(lengths, seed=4):
    g = torch.Generator().manual_seed(seed)
    return [Prompt(torch.randint(3, 128, (k,), generator=g).tolist(), torch.randint(3, 128, (3,), generator=g).tolist())
            for k in lengths]


def test_a_batch_across_longropes_switch_is_refused_and_one_side_of_it_equals_batch_1():
    """transformers turns every row of a forward by one choice of longrope factors, made from the longest row:
    a row of 40 tokens beside one of 80 gets the long factors it would not get alone, so the batch gives other
    tokens than its rows alone (transformers' own batch shows it). kveval refuses such a forward in one line
    naming batch size 1; batches on one side of the switch equal batch 1 and transformers' batch 1."""
    from kveval.errors import UnsupportedModelError

    model = _longrope_phi3()
    steps = 6
    across = _prompts_of([40, 80, 45])
    hf_alone = [_hf_generate(model, [p], None)[0] for p in across]
    assert _hf_generate(model, across, None) != hf_alone  # the batch-wide choice changes tokens
    with pytest.raises(UnsupportedModelError, match="use batch_size=1"):
        generate(model, Tok(), across, parse_policy("none"), max_new_tokens=steps, batch_size=3, kv_dtype=model.dtype)
    alone = [r.token_ids for r in generate(model, Tok(), across, parse_policy("none"), max_new_tokens=STEPS, batch_size=1,
                                           kv_dtype=model.dtype)]
    assert alone == hf_alone
    for lengths in ([20, 30, 44], [70, 90, 66]):  # every forward under the switch, or every one past it
        prompts = _prompts_of(lengths)
        hf_one = [_hf_generate(model, [p], None)[0] for p in prompts]
        batched = [r.token_ids for r in generate(model, Tok(), prompts, parse_policy("none"), max_new_tokens=STEPS, batch_size=3,
                                                 kv_dtype=model.dtype)]
        assert batched == hf_one, lengths


@pytest.mark.parametrize("context, question, batch_size", [(60, 3, 1), (62, 3, 1), (60, 3, 3)])
def test_a_row_crossing_longropes_switch_after_its_first_forward_is_refused(context, question, batch_size):
    """A row of 63 tokens generating 12 crosses the switch at 64 during its decode (one of 62 + 3, at its
    question's forward): its earlier keys keep the short factors, its later ones get the long, while transformers'
    generate for Phi-3 recomputes the whole cache with the long factors there; kveval's rows gave other tokens
    than transformers' batch 1 (at batch 1 as at 3). Refused before any forward, naming the fix; the forward that
    would cross, met on another path (a cache driven step by step), is refused too."""
    from kveval.errors import UnsupportedModelError
    from kveval.modeling.rope import check_rope_batch

    model = _longrope_phi3()
    prompts = [Prompt(p.context[:context], p.question[:question]) for p in _prompts_of([80] * batch_size)]
    with pytest.raises(UnsupportedModelError, match="max_new_tokens within 64 tokens"):
        generate(model, Tok(), prompts, parse_policy("none"), max_new_tokens=STEPS, batch_size=batch_size, kv_dtype=model.dtype)
    with pytest.raises(UnsupportedModelError, match="across longrope RoPE's switch"):
        check_rope_batch(model, [63], [64 + 1], [True])
    check_rope_batch(model, [0], [80], [True])  # a first forward past it: every key long
    check_rope_batch(model, [62], [64], [True])  # up to the switch: every key short
    if context + question <= 64:  # generating within the switch, the same rows run
        generate(model, Tok(), prompts, parse_policy("none"), max_new_tokens=64 - context - question + 1, batch_size=batch_size)


def test_dynamic_ntk_starts_every_batch_from_its_own_base_and_batches_past_it_of_one_length():
    """Dynamic NTK grows its base to the forward's longest row once past its original length (64 here), and
    transformers keeps the grown base until a forward shorter than that length: a batch's angles depended on the
    batches before it. kveval resets the base at each batch's first forward, so rows of one length past the
    switch give, together, in any order of batches, the tokens each gives alone on a fresh model; rows of
    different lengths past it are refused before any forward, and a forward that would mix them on the way."""
    from kveval.errors import UnsupportedModelError
    from kveval.modeling.rope import check_rope_batch, rope_switches

    from tiny_models import tiny_model

    def check(lengths, active):
        check_rope_batch(fresh, [0] * len(lengths), lengths, active)

    def model():
        made = tiny_model("llama", max_position_embeddings=64,
                          rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0})
        with torch.no_grad():
            for layer in made.model.layers:
                layer.self_attn.q_proj.weight.mul_(8)
        return made

    def tokens(made, prompts, batch_size):
        return [r.token_ids for r in generate(made, Tok(), prompts, parse_policy("none"), max_new_tokens=STEPS,
                                              batch_size=batch_size, kv_dtype=made.dtype)]

    fresh, used = model(), model()
    long_run = _prompts_of([120], seed=9)
    same = [Prompt(p.context[:70], p.question) for p in _prompts_of([80, 80, 80])]
    alone = [tokens(fresh, [p], 1)[0] for p in same]  # each on the model as loaded... then grown by the last
    tokens(used, long_run, 1)  # grows the base to 134 positions
    assert tokens(used, same, 3) == alone
    tokens(used, long_run, 1)
    assert tokens(used, same, 1) == alone
    with pytest.raises(UnsupportedModelError, match="use batch_size=1"):
        generate(used, Tok(), _prompts_of([70, 75]), parse_policy("none"), max_new_tokens=2, batch_size=2)
    # Policies continuing one shared prefill in turn: each as it runs alone, whatever the one before grew.
    specs = ["snapkv(ratio=0.5)", "none", "h2o(ratio=0.5)"]
    alone_each = [tokens(fresh, same, 3) if spec == "none" else
                  [r.token_ids for r in generate(fresh, Tok(), same, parse_policy(spec), max_new_tokens=STEPS, batch_size=3,
                                                 kv_dtype=fresh.dtype)] for spec in specs]
    tokens(used, long_run, 1)
    shared = [[r.token_ids for r in results]
              for _, results in generate_each(used, Tok(), same, [parse_policy(p) for p in specs], max_new_tokens=STEPS, kv_dtype=used.dtype)]
    assert shared == alone_each

    assert [(s.kind, s.positions) for s in rope_switches(fresh)] == [("dynamic", 64)]
    check([40, 64, 1], [True, True, True])  # under the switch: the static angles
    check([80, 80, 80], [True, True, False])  # past it, of one length
    for lengths, active in (([80, 90], [True, True]), ([80, 80, 90], [True, True, False])):
        # A finished row (no tokens in the forward) still sets the longest position the module sees.
        with pytest.raises(UnsupportedModelError, match="use batch_size=1"):
            check(lengths, active)
    check([90], [True])  # one row: its own choice
    check_rope_batch(fresh, [60], [80], [True])  # dynamic NTK: a row crossing keeps transformers' own mix
    assert rope_switches(tiny_model("llama")) == ()


@pytest.mark.usefixtures("calibration_cache")  # the generations calibrate again, not from disk
def test_llama4_calibrations_run_inside_kvevals_forward_as_outside_it():
    """DuoAttention, lowrank and latent calibrate on their first use, inside the forward kveval drives, where the
    Llama 4 query temperature is kveval's (per row). Their own forwards declare no positions: they run with the
    modules' own scaling, so they give what they give outside (it raised, so these policies could not run)."""
    from kveval.calibration import kv as lowrank
    from kveval.calibration import retrieval_heads
    from kveval.modeling.architectures import row_query_temperatures

    from tiny_models import tiny_model

    model = tiny_model("llama4", attn_temperature_tuning=True, floor_scale=16, attn_scale=0.5)
    text = lowrank.read_calibration_text()
    outside_kv, _ = lowrank.calibration_kv(model, text, 96)
    outside_heads = retrieval_heads.calibrate(model, 64)
    with row_query_temperatures(model):
        inside_kv, _ = lowrank.calibration_kv(model, text, 96)
        inside_heads = retrieval_heads.calibrate(model, 64)
        tuned = [layer.self_attn for layer in model.model.layers if not layer.self_attn.use_rope]
        assert not any(module.attn_temperature_tuning for module in tuned)  # kveval's again once they are done
    for (k1, v1), (k2, v2) in zip(outside_kv, inside_kv):
        assert torch.equal(k1, k2) and torch.equal(v1, v2)
    torch.testing.assert_close(outside_heads.scores, inside_heads.scores, rtol=0, atol=0, equal_nan=True)  # nan: chunked layer
    prompts = _prompts(n=3)
    for spec in ("duo(heads=0.5,calib_tokens=64)", "latent(rank=16,calib_tokens=96)", "lowrank(rank=8,calib_tokens=96)"):
        alone = [r.token_ids for r in generate(model, Tok(), prompts, parse_policy(spec), max_new_tokens=4, batch_size=1)]
        assert [r.token_ids for r in generate(model, Tok(), prompts, parse_policy(spec), max_new_tokens=4, batch_size=3)] == alone
