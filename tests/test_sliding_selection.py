"""Selection on models whose every attention layer slides (Mistral-7B-v0.1's 4096-token window, Phi-3-mini-4k's
2047, Phi-3.5-mini's 262144): the policy selects among the tokens the model's own window holds (window - 1), and
the window keeps trimming what it selected as decoding moves on. These were refused before, every selection policy
on every such model."""

import pytest
import torch

from kveval.cache.compressed import CompressedCache
from kveval.cache.exactness import prefill_and_decode
from kveval.planner.memory import plan
from kveval.policies.spec import parse_policy
from kveval.runner.generation import generate
from kveval.tensors.batch_buffer import PAD_POSITION

from cache_runs import assert_shared_prefill_equals_own_runs, random_ids, random_prompts
from tiny_models import Tok, tiny_model

pytestmark = pytest.mark.usefixtures("calibration_cache")

FP32 = torch.float32
SELECTION = ["snapkv(ratio=0.5)", "h2o(ratio=0.5)", "tova(ratio=0.5)", "knorm(ratio=0.5)", "random(ratio=0.5)",
             "pyramidkv(ratio=0.5)", "streaming(sink=4,window=12)", "window(size=12)",
             "snapkv(ratio=0.5,adaptive=true)", "h2o(ratio=0.5,decode_budget=14)",
             "knorm(ratio=0.5,decode_budget=10,adaptive=true)", "duo(heads=0.5,window=8,calib_tokens=64)",
             "snapkv(ratio=0.5)+kivi(bits=4,group=16,residual=4)"]
WINDOW = 24
#: Duo's calibration probes (64 tokens) do not fit a 24-token window (refused: test_duo_calibration_...).
NARROW = [spec for spec in SELECTION if not spec.startswith("duo")] + ["duo(heads=0,window=8)"]


def _prompts():
    return random_prompts([(40, 3), (27, 1), (33, 4)], seed=5)


def _held(result):
    s = result.stats
    return result.token_ids, s.kv_bytes, s.nominal_bytes, s.index_bytes, s.kept_tokens


@pytest.mark.parametrize("spec", SELECTION)
@pytest.mark.parametrize("mode", ["context", "query"])
def test_a_window_wider_than_the_run_selects_as_the_model_without_one(spec, mode):
    """Mistral's default 4096-token window never trims a 40-token prompt: every policy gives the answers, bytes and
    kept tokens of the same weights with no window (sliding_window=None), which select as before. Refused before."""
    wide, plain = tiny_model("mistral", sliding_window=4096), tiny_model("mistral")
    kwargs = dict(max_new_tokens=6, mode=mode, batch_size=3)
    with torch.no_grad():
        slid = generate(wide, Tok(), _prompts(), parse_policy(spec), **kwargs)
        full = generate(plain, Tok(), _prompts(), parse_policy(spec), **kwargs)
    assert [_held(r) for r in slid] == [_held(r) for r in full]
    assert all(r.stats.kv_bytes < r.stats.nominal_bytes for r in slid)  # it selected: fewer bytes than the model's


@pytest.mark.parametrize("spec", NARROW)
def test_a_narrow_window_trims_what_the_policy_selected(spec):
    """A 24-token window under a 60-token prompt and 10 decode steps: the prefill keeps the policy's share of the
    window - 1 tokens the model's own cache holds, and every token held at the end lies inside the window of the
    next query (position 70), in every layer and head; fewer than the model's own 23."""
    model = tiny_model("mistral", sliding_window=WINDOW)
    cache = CompressedCache(model, parse_policy(spec), kv_dtype=FP32)
    with torch.no_grad():
        prefill_and_decode(model, cache, random_ids(60, 3), 0)
        policy = parse_policy(spec).selection
        for layer in cache.layers:
            row = layer.rows[0]
            real = row.positions[row.positions != PAD_POSITION]
            assert int(real.min()) > 60 - WINDOW and row.kept_tokens() <= WINDOW - 1, spec
            if not policy.per_head_budgets:
                keep = policy.keep_count(WINDOW - 1, layer.layer_idx, len(cache.layers))
                assert row.store.length == keep, (spec, layer.layer_idx)
        assert cache.stats().kv_bytes < cache.stats().nominal_bytes, spec
        cache = CompressedCache(model, parse_policy(spec), kv_dtype=FP32)
        logits = prefill_and_decode(model, cache, random_ids(60, 3), 10)
    assert all(bool(torch.isfinite(x).all()) for x in logits), spec
    for layer in cache.layers:
        positions = layer.rows[0].positions
        real = positions[positions != PAD_POSITION]
        assert int(real.max()) == 69, spec
        for head in positions:  # each head: at most the window's 23 tokens, each once
            held = head[head != PAD_POSITION]
            assert held.numel() == held.unique().numel() <= WINDOW - 1, spec
        # Tokens the next query cannot see are held only where heads sharing a store keep equal counts: at most
        # as many as the head that still sees the most.
        visible = (positions > 70 - WINDOW) & (positions != PAD_POSITION)
        assert positions.shape[1] == int(visible.sum(dim=1).max()), spec
    stats = cache.stats()
    assert stats.kv_bytes < stats.nominal_bytes, spec


@pytest.mark.parametrize("spec", NARROW)
@pytest.mark.parametrize("mode", ["context", "query"])
def test_a_batch_on_a_narrow_window_gives_the_answers_and_bytes_of_batch_one(spec, mode):
    """Prompts of 40, 27 and 33 tokens past a 24-token window, questions of 3, 1 and 4 tokens, EOS on (row 0's
    first answer token: it ends before any step)."""
    model = tiny_model("mistral", sliding_window=WINDOW)
    prompts = _prompts()
    with torch.no_grad():
        seeds = [7, 11, 13]  # each row its own (an item's): the random control's choices do not depend on the batch
        model.generation_config.eos_token_id = generate(model, Tok(), prompts[:1], parse_policy(spec), max_new_tokens=1, mode=mode,
                                                        seed=seeds[:1])[0].token_ids[0]
        alone = [generate(model, Tok(), [p], parse_policy(spec), max_new_tokens=8, mode=mode, seed=[s])[0]
                 for p, s in zip(prompts, seeds)]
        together = generate(model, Tok(), prompts, parse_policy(spec), max_new_tokens=8, mode=mode, batch_size=3, seed=seeds)
    assert alone[0].token_ids == [] and any(len(r.token_ids) > 1 for r in alone[1:])
    assert [_held(r) for r in alone] == [_held(r) for r in together]


def test_one_shared_prefill_on_a_narrow_window_gives_each_policy_its_own_run():
    model = tiny_model("mistral", sliding_window=WINDOW)
    with torch.no_grad():
        assert_shared_prefill_equals_own_runs(model, Tok(), _prompts(), ["none"] + NARROW, max_new_tokens=6,
                                              batch_size=3, kv_dtype=FP32)


@pytest.mark.parametrize("spec", ["snapkv(ratio=0.5)", "streaming(sink=4,window=12)", "h2o(ratio=0.5,decode_budget=14)",
                                  "snapkv(ratio=0.5)+kivi(bits=4,group=16,residual=4)", "pyramidkv(ratio=0.5)"])
def test_the_planner_sizes_selection_on_sliding_layers_where_the_bytes_are_known(spec):
    """The planner's bytes are the cache's where nothing the policy selected can leave the window (no decode, or
    a run shorter than the window); where it can, which selected tokens leave depends on the scores: refused in one
    line, where before every selection on such a model was."""
    import sys

    sys.path.insert(0, "tests")
    from cache_runs import context_then_steps

    model = tiny_model("mistral", sliding_window=WINDOW)
    for context, steps in ((60, 0), (15, 6), (23, 0)):
        _, cache = context_then_steps(model, spec, random_ids(context, 1), random_ids(max(steps, 1), 2)[:, :steps],
                                      kv_dtype=torch.bfloat16)
        planned = plan(model.config, context, policy=parse_policy(spec), dtype_bytes=2, new_tokens=steps)
        measured = cache.stats()
        assert (planned.sequence_bytes, planned.baseline_sequence_bytes) == (measured.kv_bytes, measured.nominal_bytes), \
            (spec, context, steps)
    with pytest.raises(ValueError, match="leave the window while decoding") as refused:
        plan(model.config, 60, policy=parse_policy(spec), dtype_bytes=2, new_tokens=6)
    assert "\n" not in str(refused.value)


def test_mistral_7b_plans_selection_at_its_window():
    per_token = 32 * 8 * 128 * 2 * 2
    assert plan("mistral-7b", 16384, policy=parse_policy("snapkv(ratio=0.5)")).sequence_bytes == 2048 * per_token  # of 4095
    assert plan("mistral-7b", 3000, policy=parse_policy("snapkv(ratio=0.5)"), new_tokens=64).sequence_bytes == (1500 + 64) * per_token


@pytest.mark.parametrize("spec", ["window(ratio=0.5)", "streaming(sink=4,ratio=0.5)"])
def test_attention_over_what_is_kept_equals_the_eager_model_under_that_mask(spec):
    """A reference outside kveval: position-based prefill policies keep the same tokens in every layer and head, so
    the eager model can attend over exactly those. After a 60-token prefill the window holds 37..59 and the policy
    keeps the newest 12 of those 23 (streaming's sinks, positions 0..3, left the window before it selected); the
    query at position p then sees them and the decoded tokens, inside its window (k > p - 24). Every decode
    step's logits equal the eager model's under that explicit mask (and differ without it)."""
    kept = list(range(48, 60))
    model, eager = tiny_model("mistral", sliding_window=WINDOW), tiny_model("mistral", sliding_window=WINDOW, attn="eager")
    ids = random_ids(60, 3)
    cache = CompressedCache(model, parse_policy(spec), kv_dtype=FP32)
    with torch.no_grad():
        logits = prefill_and_decode(model, cache, ids, 10)
        decoded = torch.cat([step[:, -1:].argmax(-1) for step in logits[:-1]], dim=1)
        sequence = torch.cat([ids, decoded], dim=1)  # positions 0..69
        n = sequence.shape[1]
        q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
        allowed = (k <= q) & (k > q - WINDOW)
        held = torch.zeros(n, dtype=torch.bool)
        held[kept] = True
        held[60:] = True
        allowed[60:] &= held[None, :]
        mask = torch.zeros(1, 1, n, n).masked_fill(~allowed, float("-inf"))
        reference = eager(sequence, attention_mask=mask, position_ids=torch.arange(n)[None]).logits
        unmasked = eager(sequence, position_ids=torch.arange(n)[None]).logits
    for layer in cache.layers:  # what is held at the end: the window has moved on past 46
        assert layer.rows[0].positions.tolist() == [[p for p in kept + list(range(60, 70)) if p > 70 - WINDOW]] * 2
    for step in range(1, 11):  # the forward of position 59 + step
        torch.testing.assert_close(logits[step][0, -1], reference[0, 59 + step], atol=1e-5, rtol=1e-5)
    assert float((logits[1][0, -1] - unmasked[0, 60]).abs().max()) > 1e-2


def test_duo_calibration_longer_than_the_window_is_refused():
    """Duo ranks heads by the attention answer queries give a needle; where the probe is longer than the sliding
    window selection acts on, the needle has left the window and the ranking would rest on nothing (it did: the
    needle's slots were read by position in a trimmed row). Refused in one line, naming what fits."""
    import re

    from kveval.errors import UsageError

    model = tiny_model("mistral", sliding_window=256)
    with pytest.raises(UsageError, match=r"calib_tokens=160\): its passkey probes .* 256-token sliding window") as refused:
        with torch.no_grad():  # calibrated on first use, at the first compression
            prefill_and_decode(model, CompressedCache(model, parse_policy("duo(heads=0.5,window=8,calib_tokens=160)")), random_ids(60, 3), 0)
    assert "\n" not in str(refused.value)
    fits = int(re.search(r"give calib_tokens=(\d+) or fewer", str(refused.value)).group(1))
    with torch.no_grad():  # what it names calibrates: 2 of the 4 KV heads keep all 60 tokens, 2 keep 4 + 8
        cache = CompressedCache(model, parse_policy(f"duo(heads=0.5,window=8,calib_tokens={fits})"))
        prefill_and_decode(model, cache, random_ids(60, 3), 0)
    stats = cache.stats()
    assert stats.kv_bytes * 120 == stats.nominal_bytes * (60 + 12)


def test_the_largest_context_under_selection_on_sliding_layers():
    """Mistral-7B (window 4096), snapkv(ratio=0.5), 32 new tokens: contexts up to 4063 are sized (nothing selected
    can leave the window); past them the window bounds the cache at its 4095 tokens whatever the policy keeps. The
    search refused before (it sized a context of 2**50 tokens first)."""
    from kveval.planner.memory import max_fit

    gib, per_token, policy = 1 << 30, 32 * 8 * 128 * 2 * 2, "snapkv(ratio=0.5)"

    def fit(budget):
        return max_fit("mistral-7b", budget + gib, weights=str(gib), headroom=0, policy=parse_policy(policy), new_tokens=32)

    roomy = fit(4095 * per_token)
    assert roomy.value is None and any("any context fits" in n for n in roomy.notes)
    between = fit(3000 * per_token)  # (2032 + 32) tokens at 4063 fit; the window's 4095 do not
    assert between.value == 4063 and any("longest context sized" in n for n in between.notes)
    tight = fit(1000 * per_token)  # ceil(n / 2) + 32 <= 1000
    assert tight.value == 1936
    assert plan("mistral-7b", 1936, policy=parse_policy(policy), new_tokens=32).sequence_bytes <= 1000 * per_token
    assert plan("mistral-7b", 1937, policy=parse_policy(policy), new_tokens=32).sequence_bytes > 1000 * per_token


def test_a_batch_decodes_at_once_until_the_window_reaches_what_was_kept(monkeypatch):
    """Where the window trims nothing the selection kept, the batch decodes as a full layer's would, at once (the
    rows leave gaps a window's own eviction does not take); once the window reaches the oldest kept token, row by
    row, trimming by position. Before, every step went row by row (snapkv 1.14x of none at batch 8 on a
    SmolLM2-shaped Mistral, h2o with a decode budget 1.55x; SmolLM2 itself 0.99x and 1.08x)."""
    from kveval.cache.buffered_decode import BufferedDecode

    steps = []
    append = BufferedDecode.append
    monkeypatch.setattr(BufferedDecode, "append", lambda self, *a, **k: (steps.append(1), append(self, *a, **k))[1])
    wide = tiny_model("mistral", sliding_window=4096)
    with torch.no_grad():
        generate(wide, Tok(), _prompts(), parse_policy("snapkv(ratio=0.5)"), max_new_tokens=6, batch_size=3)
    assert len(steps) == 2 * 6  # both layers: the question's forward and every decode step after it
    steps.clear()
    narrow = tiny_model("mistral", sliding_window=WINDOW)
    with torch.no_grad():  # contexts of 12: 6 kept at positions 6..11
        generate(narrow, Tok(), random_prompts([(12, 2)] * 3, seed=2), parse_policy("window(ratio=0.5)"), max_new_tokens=24,
                 batch_size=3)
    # The oldest kept position is 6: forwards whose positions stay below 30 (the question at 12-13, decode steps
    # at 14..28) go at once, the 9 from position 29 on row by row.
    assert len(steps) == 2 * 16


def test_generation_past_the_window_equals_the_eager_model_under_the_kept_mask():
    """The reference test through generate (its batched decode, then row by row once the window reaches the kept
    tokens): a 12-token context keeps positions 6..11 under window(ratio=0.5), the 2-token question and 24 new
    tokens follow, and every generated token's log-probability is the eager model's under the explicit mask."""
    model, eager = tiny_model("mistral", sliding_window=WINDOW), tiny_model("mistral", sliding_window=WINDOW, attn="eager")
    (prompt,) = random_prompts([(12, 2)], seed=2)
    with torch.no_grad():
        (result,) = generate(model, Tok(), [prompt], parse_policy("window(ratio=0.5)"), max_new_tokens=24, kv_dtype=FP32)
        sequence = torch.tensor([prompt.context + prompt.question + result.token_ids[:-1]])
        n = sequence.shape[1]
        q, k = torch.arange(n)[:, None], torch.arange(n)[None, :]
        allowed = (k <= q) & (k > q - WINDOW)
        allowed[12:, :6] = False  # the half of the context the policy dropped, for every query after it
        mask = torch.zeros(1, 1, n, n).masked_fill(~allowed, float("-inf"))
        logits = eager(sequence, attention_mask=mask, position_ids=torch.arange(n)[None]).logits[0, 13:]
    expected = logits.log_softmax(-1).gather(1, torch.tensor(result.token_ids)[:, None]).squeeze(1)
    assert len(result.token_ids) == 24
    torch.testing.assert_close(torch.tensor(result.logprobs, dtype=torch.float32), expected, atol=1e-4, rtol=1e-4)


def test_the_planner_and_the_cache_agree_on_chunked_layers():
    """Where every attention layer is chunked (Llama 4's local layers alone), no layer takes a selection: the cache
    refuses it and so does the planner, which sized it before (it read chunks as sliding windows)."""
    from kveval.errors import UnsupportedModelError

    model = tiny_model("llama4", layer_types=["chunked_attention", "chunked_attention"])
    with pytest.raises(UnsupportedModelError, match="every attention layer is chunked"):
        CompressedCache(model, parse_policy("snapkv(ratio=0.5)"))
    with pytest.raises(ValueError, match="every attention layer of .* is chunked"):
        plan(model.config, 100, policy=parse_policy("snapkv(ratio=0.5)"))
    assert plan(model.config, 100, policy=parse_policy("kivi(bits=4)")).sequence_bytes > 0


def test_a_llama4_config_json_without_layer_types_plans_its_chunks():
    """A raw config.json of Llama 4 names its chunked layers by attention_chunk_size and no_rope_layers alone; the
    planner read every layer as full attention and sized a selection on all of them, where the cache selects on
    the global layers only."""
    from kveval.planner.model_specs import load_model_spec

    model = tiny_model("llama4")
    config = model.config.to_dict()
    config.pop("layer_types", None)
    spec = load_model_spec(config)
    assert spec.chunked == [True, False] and spec.windows == [16, None]
    cache = CompressedCache(model, parse_policy("snapkv(ratio=0.5)"), kv_dtype=torch.bfloat16)
    with torch.no_grad():
        model(random_ids(100, 1), cache=cache)
    assert plan(config, 100, policy=parse_policy("snapkv(ratio=0.5)")).sequence_bytes == cache.stats().kv_bytes
