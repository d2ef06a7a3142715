"""The architecture matrix: tiny random configs of 26 causal-LM architectures (see tiny_models.ARCHITECTURES).

Per architecture: policy ``none`` equals the model's own eager attention through
prefill and decode; every policy family and a stacked policy run with finite
logits and fewer bytes than the uncompressed cache; batch 3 gives the answers
and bytes of batch 1. Then the variant-specific checks: hybrid states kept
exactly, MLA caches the latent, scoring sees softcapped / sink probabilities,
unknown layer types and inexact models are refused.
"""

import pytest
import torch
from transformers import DynamicCache
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from kveval.cache.compressed import CompressedCache, nominal_bytes_per_token
from kveval.cache.exactness import measure_exactness, prefill_and_decode, self_check
from kveval.errors import UnsupportedModelError
from kveval.modeling import architectures
from kveval.policies.spec import parse_policy
from kveval.runner.generation import Prompt, generate

from tiny_models import ARCHITECTURES, NATIVE_ARCHITECTURES, Tok, tiny_model

# Calibrations (lowrank, latent, kvquant, duo) of this file's own: one remembered or on disk from another run
# would stand in for the calibration pass under test.
pytestmark = pytest.mark.usefixtures("calibration_cache")

NAMES = sorted(ARCHITECTURES)
# One of each family, and a stack; tiny sizes so every family really compresses 64 tokens.
POLICIES = ["snapkv(ratio=0.5)", "h2o(ratio=0.5)", "tova(ratio=0.5)", "streaming(sink=4,window=16)",
            "kivi(bits=4,residual=8)", "quant(bits=8,group=16)", "lowrank(rank=8,calib_tokens=96)",
            "snapkv(ratio=0.5)+kivi(bits=2,residual=8)"]
FP32 = torch.float32


def _ids(n, seed):
    return torch.randint(3, 128, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("name", NAMES + sorted(NATIVE_ARCHITECTURES))
def test_none_equals_eager_through_prefill_and_decode(name):
    model, reference = tiny_model(name), tiny_model(name, attn="eager")
    ids = _ids(40, 0)
    with torch.no_grad():
        cache = CompressedCache(model, parse_policy("none"), kv_dtype=FP32)
        own = DynamicCache(config=reference.config)
        ours, theirs = prefill_and_decode(model, cache, ids, 6), prefill_and_decode(reference, own, ids, 6)
    assert max(float((a - b).abs().max()) for a, b in zip(ours, theirs)) <= 1e-5
    stats = cache.stats()
    assert stats.kv_bytes == stats.nominal_bytes  # none keeps what the model's own cache keeps
    if not any(p.sliding_window for p in architectures.cache_layer_plan(model.config)):
        # The per-token figure lm-eval runs record: attention layers only (MLA: latent + rope key).
        assert nominal_bytes_per_token(model, FP32) * 46 == stats.nominal_bytes
    # Linear-attention / Mamba states: the very tensors the model's own cache holds, counted apart.
    state_layers = [i for i, layer in enumerate(own.layers) if isinstance(layer, LinearAttentionCacheLayerMixin)]
    for i in state_layers:
        for which in ("conv_states", "recurrent_states"):
            for a, b in zip(getattr(cache.layers[i], which).values(), getattr(own.layers[i], which).values()):
                assert (a is None) == (b is None)
                if a is not None:  # the same states up to the attention kernels' rounding upstream
                    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # DeepSeek V4's compressors keep their pending tokens and overlap between forwards: state too.
    assert (stats.state_bytes > 0) == (bool(state_layers) or name == "deepseek_v4")


#: Decode-phase compression (docs/methods.md): the budget kept every 4 steps (kvpress's DecodingPress), and R-KV.
DECODE_PHASE = ["knorm(ratio=0.5,decode_budget=24,decode_interval=4)",
                "rkv(ratio=0.5,decode_budget=24,decode_interval=4,window=4)"]


@pytest.mark.parametrize("name", NAMES)
def test_decode_phase_policies_keep_their_budget_while_decoding(name):
    """64 tokens halved to 32, then 6 decode steps: over decode_budget + decode_interval - 1 = 27 tokens after the
    first step, every selecting layer is compressed to 24, and holds at most 27 between steps. R-KV's queries do not
    meet an MLA latent's keys: refused in one line."""
    model = tiny_model(name)
    ids = _ids(64, 1)
    for spec in DECODE_PHASE:
        cache = CompressedCache(model, parse_policy(spec))
        try:
            with torch.no_grad():
                logits = prefill_and_decode(model, cache, ids, 6)
        except UnsupportedModelError as exc:
            assert spec.startswith("rkv") and "MLA" in str(exc), (spec, exc)
            continue
        stats = cache.stats()
        assert all(bool(torch.isfinite(x).all()) for x in logits), spec
        assert 0 < stats.kv_bytes < stats.nominal_bytes, spec
        assert max(max(layer) for layer in stats.kept_tokens) <= 27, spec


def _runs_below_nominal_bytes(model, spec: str):
    """64 tokens and 2 decode steps under ``spec``: finite logits, fewer bytes than the uncompressed cache; the
    cache's stats."""
    cache = CompressedCache(model, parse_policy(spec))
    with torch.no_grad():
        logits = prefill_and_decode(model, cache, _ids(64, 1), 2)
    stats = cache.stats()
    assert all(bool(torch.isfinite(x).all()) for x in logits), spec
    assert 0 < stats.kv_bytes < stats.nominal_bytes, spec
    return stats


@pytest.mark.parametrize("name", NAMES)
def test_every_policy_family_runs_below_nominal_bytes(name):
    model = tiny_model(name)
    for spec in POLICIES:
        _runs_below_nominal_bytes(model, spec)


# The models whose own cache layers kveval mirrors part by part (kveval.cache.native_layers) take a selection that
# needs no attention (V3.2's latent: one decision per token for all heads; V4's compressed entries, by ratio) and the
# quantizers that code each part; structure is refused there (tests/test_deepseek_cache.py). One of each family
# they take, and a stack: every part measured below the model's own cache.
NATIVE_POLICIES = {
    "deepseek_v32": ["knorm(ratio=0.5)", "window(size=20)", "kivi(bits=4,residual=8,group=8)", "quant(bits=8,group=8)",
                     "fp8(group=8)", "kvquant(bits=4,pre_rope=false,calib_tokens=96)",
                     "knorm(ratio=0.5)+kivi(bits=2,residual=8,group=8)"],
    "deepseek_v4": ["knorm(ratio=0.5)", "streaming(ratio=0.5,sink=4)", "quant(bits=8,group=16)", "fp8(group=16)",
                    "kivi(bits=4,residual=0,group=4)", "kvquant(bits=2,pre_rope=false,calib_tokens=96)",
                    "knorm(ratio=0.5)+quant(bits=4,group=16,indexer=fp8)",
                    "random(ratio=0.5)+kvquant(bits=4,pre_rope=false,calib_tokens=96,indexer=fp8)"],
}
NATIVE_POLICIES["glm_moe_dsa"] = ["window(size=20)", *NATIVE_POLICIES["deepseek_v32"][2:6]]


@pytest.mark.parametrize("name", sorted(NATIVE_ARCHITECTURES))
def test_every_policy_family_a_native_cache_takes_runs_below_its_bytes(name):
    model = tiny_model(name)
    for spec in NATIVE_POLICIES[name]:
        stats = _runs_below_nominal_bytes(model, spec)
        # A selection on V4's entries leaves its sliding window as the model holds it; KIVI codes K by channel in
        # whole groups of tokens, which a window of 7 sliding entries never seals.
        whole = ({"window"} if name == "deepseek_v4" and "+" not in spec
                 and spec.startswith(("knorm(", "streaming(", "kivi(")) else set())
        assert all(stats.parts[p] < stats.nominal_parts[p] for p in set(stats.parts) - whole), (spec, stats.parts)
        assert all(stats.parts[p] == stats.nominal_parts[p] for p in whole), (spec, stats.parts)
    for spec in ("lowrank(rank=8,calib_tokens=96)", "latent(rank=8,calib_tokens=96)"):
        with pytest.raises(UnsupportedModelError, match="no low-rank basis for its parts"):
            CompressedCache(model, parse_policy(spec))


@pytest.mark.parametrize("name", NAMES + sorted(NATIVE_ARCHITECTURES))
@pytest.mark.parametrize("policy, mode", [("snapkv(ratio=0.5)+kivi(bits=4,residual=8)", "context"),
                                          ("window(size=20)", "query")])
def test_batch_of_three_gives_the_answers_and_bytes_of_batch_one(name, policy, mode):
    """Questions of 3, 1 and 4 tokens (padded after the contexts in context mode: state layers must not see it)
    and EOS on, set to row 0's first token (it ends before any step: the others' steps must leave its cache)."""
    if name in NATIVE_ARCHITECTURES:  # the policies of the same families these caches take
        policy = {"deepseek_v4": ["knorm(ratio=0.5)+kivi(bits=4,residual=8,group=16)", "streaming(ratio=0.5,sink=4)"],
                  "deepseek_v32": ["knorm(ratio=0.5)+kivi(bits=4,residual=8,group=8)", policy],
                  "glm_moe_dsa": ["window(size=20)+kivi(bits=4,residual=8,group=8)", policy]}[name][mode == "query"]
    model = tiny_model(name)
    prompts = [Prompt(_ids(n, 10 + n)[0].tolist(), list(range(5, 5 + q))) for n, q in ((40, 3), (27, 1), (33, 4))]
    model.generation_config.eos_token_id = generate(model, Tok(), prompts[:1], parse_policy(policy), max_new_tokens=1,
                                                    mode=mode)[0].token_ids[0]
    alone = [generate(model, Tok(), [p], parse_policy(policy), max_new_tokens=6, mode=mode)[0] for p in prompts]
    assert alone[0].token_ids == [] and any(len(r.token_ids) > 1 for r in alone[1:])
    together = generate(model, Tok(), prompts, parse_policy(policy), max_new_tokens=6, mode=mode, batch_size=3)
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids
        assert (a.stats.kv_bytes, a.stats.state_bytes, a.stats.kept_tokens) == (b.stats.kv_bytes, b.stats.state_bytes,
                                                                                b.stats.kept_tokens)


@pytest.mark.parametrize("spec", ["snapkv(ratio=0.5)", "streaming(sink=4,window=16)", "h2o(ratio=0.5)+kivi(bits=4,residual=8)"])
def test_selection_is_refused_where_every_attention_layer_is_chunked(spec):
    """Where every layer slides, selection acts on the sliding layers (tests/test_sliding_selection.py); where every
    one is chunked (a query sees only its own chunk), a selection would keep what the model keeps, and its run read
    as a lossless policy. Refused in one line; quantization still runs."""
    model = tiny_model("llama4", layer_types=["chunked_attention", "chunked_attention"])
    with pytest.raises(UnsupportedModelError, match="every attention layer is chunked") as refused:
        CompressedCache(model, parse_policy(spec))
    assert "\n" not in str(refused.value)
    cache = CompressedCache(model, parse_policy("kivi(bits=4,residual=8)"))
    with torch.no_grad():
        prefill_and_decode(model, cache, _ids(64, 1), 2)
    assert cache.stats().kv_bytes < cache.stats().nominal_bytes


def test_mla_caches_the_latent_and_the_rope_key():
    model = tiny_model("deepseek_v3")
    dims = architectures.mla_dims(model.config)
    layers = model.config.num_hidden_layers
    assert nominal_bytes_per_token(model, FP32) == (dims.kv_lora_rank + dims.qk_rope_head_dim) * layers * 4
    assert dims.per_head_elements == 4 * (16 + 32 + 16)  # what per-head K/V would hold: 2x the latent here
    cache = CompressedCache(model, parse_policy("snapkv(ratio=0.5)"), kv_dtype=FP32)
    with torch.no_grad():
        model(_ids(40, 2), cache=cache)
    row = cache.layers[0].rows[0]
    keys, values = row.store.keys_values()
    assert keys.shape == (1, 20, dims.kv_lora_rank) and values.shape == (1, 20, dims.qk_rope_head_dim)
    assert row.positions.shape == (1, 20)  # one shared "head": a token is kept or dropped for all heads at once
    assert cache.stats().kv_bytes == 20 * layers * (dims.kv_lora_rank + dims.qk_rope_head_dim) * 4
    quantized = CompressedCache(model, parse_policy("kivi(bits=4,residual=8)"), kv_dtype=FP32)
    with torch.no_grad():
        model(_ids(40, 2), cache=quantized)
    stats = quantized.stats()  # latent and rope key both quantized: 32 of 40 tokens at 4 bits, 8 in float32
    assert stats.kv_bytes < 0.4 * stats.nominal_bytes  # only one of the two quantized would be above 0.6


@pytest.mark.parametrize("name", ["gpt_oss", "gemma2", "llama"])
def test_selection_scores_with_the_models_own_attention_probabilities(name):
    """H2O's accumulated attention equals the eager model's attention weights (softcapped / with sinks)."""
    model, reference = tiny_model(name), tiny_model(name, attn="eager")
    ids = _ids(24, 3)
    cache = CompressedCache(model, parse_policy("h2o(ratio=0.5)"), kv_dtype=FP32, defer_compression=True)
    with torch.no_grad():
        model(ids, cache=cache)
        weights = reference(ids, output_attentions=True).attentions
    full = [i for i, layer in enumerate(cache.layers) if not layer.is_sliding]
    for i in full:
        w = weights[i]  # [1, heads, q, k]
        kv = cache.layers[i].rows[0].positions.shape[0]
        expected = w.reshape(1, kv, w.shape[1] // kv, *w.shape[2:]).mean(2).sum(2)[0]
        torch.testing.assert_close(cache.layers[i].rows[0].attention, expected, atol=1e-5, rtol=1e-5)
    if name == "gpt_oss":  # the sinks take their share: scores sum to less than one per query
        assert float(cache.layers[full[0]].rows[0].attention.sum()) < 0.99 * ids.shape[1] * kv


def test_unknown_cache_layer_type_is_refused():
    model = tiny_model("llama")
    model.config.layer_types = ["full_attention", "lightning_attention"]
    with pytest.raises(UnsupportedModelError, match="'lightning_attention' is not supported"):
        CompressedCache(model, parse_policy("none"))


def test_self_check_refuses_an_inexact_attention(monkeypatch):
    model = tiny_model("gpt_oss")
    assert measure_exactness(model).max_difference <= 1e-5
    monkeypatch.delitem(architectures.EAGER_VARIANTS, "learned attention sinks")  # as if kveval ignored the sinks
    with pytest.raises(UnsupportedModelError, match=r"gpt_oss: .*differs from the model's eager attention by 0\.\d"):
        self_check(model)


def test_load_model_runs_the_self_check_and_can_skip_it(tmp_path, monkeypatch):
    from kveval.runner import models

    tiny_model("qwen3").save_pretrained(tmp_path)
    monkeypatch.setattr(models, "load_tokenizer", lambda name: None)
    model, _ = models.load_model(str(tmp_path), device="cpu", dtype="float32")
    assert model.config._attn_implementation == "kveval"
    monkeypatch.setattr("kveval.cache.exactness.measure_exactness",
                        lambda m: pytest.fail("self_check=False must skip the probe"))
    models.load_model(str(tmp_path), device="cpu", dtype="float32", self_check=False)


@pytest.mark.parametrize("name", ["bamba", "falcon_h1", "llama"])
def test_forked_rows_continue_as_the_row_would_alone(name):
    """lm-eval forks a prefilled row for many continuations: states and padding history follow the row."""
    from kveval.runner.generation import forward_rows

    model = tiny_model(name)
    rows = [_ids(30, 20)[0].tolist(), _ids(22, 21)[0].tolist()]
    tail = [9, 10, 11]
    with torch.no_grad():
        cache, seen = CompressedCache(model, parse_policy("snapkv(ratio=0.5)")), [0, 0]
        forward_rows(model, cache, rows, seen, pad_id=0)
        fork = cache.fork_rows([1, 1, 0])
        forked = forward_rows(model, fork, [tail] * 3, [seen[1], seen[1], seen[0]], pad_id=0, logits_to_keep=0)[0]
        alone, alone_seen = CompressedCache(model, parse_policy("snapkv(ratio=0.5)")), [0]
        forward_rows(model, alone, [rows[1]], alone_seen, pad_id=0)
        expected = forward_rows(model, alone, [tail], alone_seen, pad_id=0, logits_to_keep=0)[0]
    torch.testing.assert_close(forked[0], expected[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(forked[1], expected[0], atol=1e-5, rtol=1e-5)
    assert fork.stats(0).kv_bytes == alone.stats().kv_bytes and fork.stats(0).state_bytes == alone.stats().state_bytes


@pytest.mark.parametrize("spec", ["none", "snapkv(ratio=0.5)", "kivi(bits=2,group=4,residual=4)"])
def test_a_forked_row_holds_its_own_tokens_not_the_batchs(spec):
    """lm-eval forks each prefilled row for its continuations. A row's tensors may view the batch's (the packed
    prefill's; the batch buffer's, where the cache is in the compute dtype; the batch's codes), and a deep copy of
    a view copies all the storage under it: each forked row held the whole batch's K/V. It holds its own, and
    continues as the row itself does."""
    from kveval.runner.generation import forward_rows

    def tensors(obj, found):
        if isinstance(obj, torch.Tensor):
            found.append(obj)
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                tensors(item, found)
        elif type(obj).__module__.startswith("kveval.") and hasattr(obj, "__dict__"):
            for item in vars(obj).values():
                tensors(item, found)
        return found

    model = tiny_model("llama")
    rows = [_ids(30, 20)[0].tolist(), _ids(22, 21)[0].tolist(), _ids(26, 22)[0].tolist()]
    with torch.no_grad():
        cache, seen = CompressedCache(model, parse_policy(spec), kv_dtype=torch.float32, quantized_decode="codes"), [0, 0, 0]
        forward_rows(model, cache, rows, seen, pad_id=0)
        fork = cache.fork_rows([1, 1])
        viewed = [t for layer in cache.attention_layers for t in tensors(layer.rows, [])
                  if t.untyped_storage().nbytes() > t.numel() * t.element_size()]
        held = tensors([layer.rows for layer in fork.attention_layers], [])
        forked = forward_rows(model, fork, [[9, 10, 11]] * 2, [seen[1]] * 2, pad_id=0, logits_to_keep=0)[0]
        expected = forward_rows(model, cache, [[9, 10, 11]] * 3, seen, pad_id=0, logits_to_keep=0)[0]
    assert viewed  # the batch's rows view the batch's tensors
    assert held and all(t.untyped_storage().nbytes() <= t.numel() * t.element_size() for t in held)
    for row in forked:  # the same row twice in a batch (a matrix product may round two rows apart)
        torch.testing.assert_close(row, expected[1], atol=1e-5, rtol=1e-5)


def _save_with_tokenizer(model, folder):
    """A model folder as a user would give it: weights, config and a (word-level) tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{f"w{i}": i for i in range(4, 128)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", unk_token="<unk>", eos_token="</s>")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def test_cli_refuses_an_unknown_layer_type_with_one_line_and_exit_2(tmp_path, capsys):
    from kveval.commands.main import main

    model = tiny_model("llama")
    model.config.layer_types = ["full_attention", "indexed_attention"]  # DeepSeek-V3.2's indexer: unknown to kveval
    _save_with_tokenizer(model, tmp_path)
    capsys.readouterr()
    assert main(["generate", "--model", str(tmp_path), "--prompt", "w5 w6 w7", "--max-new-tokens", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "cache layer type 'indexed_attention' is not supported" in err[0]


def test_cli_runs_a_model_folder_after_its_self_check(tmp_path, capsys):
    from kveval.commands.main import main

    _save_with_tokenizer(tiny_model("gemma2"), tmp_path)
    assert main(["generate", "--model", str(tmp_path), "--prompt", "w5 w6 w7", "--max-new-tokens", "2",
                 "--raw", "--dtype", "float32", "--device", "cpu"]) == 0
    assert "B/token" in capsys.readouterr().out


def test_sweep_takes_the_skip_self_check_that_the_refusal_names(tmp_path, monkeypatch):
    """The self-check's refusal names --skip-self-check: kveval sweep must have it and pass it to load_model."""
    from kveval.commands.main import main
    from kveval.errors import UsageError
    from kveval.runner import models

    loaded = []

    def fake_load_model(name, **kwargs):
        loaded.append((name, kwargs))
        raise UsageError("stop here")  # the flag's way to load_model is all this test follows

    monkeypatch.setattr(models, "load_model", fake_load_model)
    for n, flags in enumerate(([], ["--skip-self-check"])):
        assert main(["sweep", "configs/quickstart.yaml", "--out", str(tmp_path / f"run{n}"), *flags]) == 2
    assert loaded == [("smollm2-135m", {}), ("smollm2-135m", {"self_check": False})]


# kvquant's keys before RoPE need a RoPE hook, which these three models lack (refused in one line, tested elsewhere).
CALIBRATED = ["lowrank(rank=8,calib_tokens=96)", "latent(rank=16,calib_tokens=96)",
              "kvquant(bits=4,pre_rope=false,calib_tokens=96)"]


@pytest.mark.parametrize("name", ["bamba", "falcon_h1", "qwen3_next"])
def test_calibration_takes_the_kv_of_the_attention_layers_and_skips_state_layers(name):
    """lowrank, latent and kvquant calibrate on one forward's K/V. On a hybrid model only some layers hold K/V
    (Bamba: layer 1 of 3; Qwen3-Next: layer 3 of 4; Falcon-H1: both, beside a Mamba state). The pass was an
    IndexError inside transformers (a cache of plain K/V layers handed to Mamba layers), then a refusal; each
    attention layer's calibration K/V are now the very ones the model's own cache holds, state layers give none."""
    from kveval.calibration.kv import calibration_kv, read_calibration_text, tokenize_for

    model = tiny_model(name)
    text = read_calibration_text()
    kv, used = calibration_kv(model, text, 96)
    ids = torch.tensor([tokenize_for(model, text.text)[:96]])
    own = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=own, use_cache=True)
    plans = architectures.cache_layer_plan(model.config)
    assert used == 96 and len(kv) == len(plans)
    for plan, layer, pair in zip(plans, own.layers, kv):
        assert (pair is None) == (not plan.holds_tokens)
        if pair is not None:
            torch.testing.assert_close(pair[0], layer.keys[0].float(), atol=1e-5, rtol=1e-5)
            torch.testing.assert_close(pair[1], layer.values[0].float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["bamba", "falcon_h1", "qwen3_next"])
@pytest.mark.parametrize("spec", CALIBRATED)
def test_calibrating_policies_serve_state_layer_models(name, spec):
    """They compress the attention layers of a hybrid model (states kept exactly), below the nominal bytes, and
    batch 3 gives the answers and bytes of batch 1."""
    model = tiny_model(name)
    prompts = [Prompt(_ids(n, 10 + n)[0].tolist(), list(range(5, 5 + q))) for n, q in ((40, 3), (27, 1), (33, 4))]
    alone = [generate(model, Tok(), [p], parse_policy(spec), max_new_tokens=4)[0] for p in prompts]
    together = generate(model, Tok(), prompts, parse_policy(spec), max_new_tokens=4, batch_size=3)
    for a, b in zip(alone, together):
        assert a.token_ids == b.token_ids and len(a.token_ids) == 4
        assert 0 < a.stats.kv_bytes < a.stats.nominal_bytes and a.stats.state_bytes > 0
        assert (a.stats.kv_bytes, a.stats.state_bytes) == (b.stats.kv_bytes, b.stats.state_bytes)


STATE_NAMES = ["bamba", "falcon_h1", "qwen3_next"]  # Mamba, attention and Mamba in one layer, gated delta rule


@pytest.mark.parametrize("name", STATE_NAMES)
def test_state_layers_never_see_padding_after_a_rows_first_forward(name):
    """A left-padded forward continuing a cache (context mode's questions, lm-eval's continuations, rows that ended)
    pads rows whose state already holds their tokens. Attention masks padding; a linear-attention or Mamba state
    does not: transformers zeroes a padded input, and the state still decays over it (and the conv window shifts).
    Batch N gave other answers than batch 1 without a word. Such a forward now runs once per length of the rows'
    new tokens (one with no padding for each row) and rows given nothing keep their states."""
    from kveval.runner.generation import forward_rows

    model = tiny_model(name)
    rows = [_ids(30, 20)[0].tolist(), _ids(22, 21)[0].tolist(), _ids(26, 22)[0].tolist()]
    tails = [[9, 10, 11, 12, 13], [14], [15, 16, 17]]
    with torch.no_grad():
        cache, seen = CompressedCache(model, parse_policy("none")), [0, 0, 0]
        forward_rows(model, cache, rows, seen, pad_id=0)
        batched, mask = forward_rows(model, cache, tails, seen, pad_id=0, logits_to_keep=0)
        assert batched.shape[1] == mask.shape[1] == 5 and mask.sum(dim=1).tolist() == [5, 1, 3]
        assert seen == [35, 23, 29]
        # A row given nothing (it ended) keeps its states: its next token continues as alone.
        after_idle = forward_rows(model, cache, [[], [7, 8], [7]], seen, pad_id=0)[0]
        then = forward_rows(model, cache, [[6], [6], [6]], seen, pad_id=0)[0]
        for b in range(3):
            alone, alone_seen = CompressedCache(model, parse_policy("none")), [0]
            forward_rows(model, alone, [rows[b]], alone_seen, pad_id=0)
            expected = forward_rows(model, alone, [tails[b]], alone_seen, pad_id=0, logits_to_keep=0)[0]
            n = len(tails[b])
            torch.testing.assert_close(batched[b, 5 - n:], expected[0], atol=1e-4, rtol=1e-4)
            if b:
                expected = forward_rows(model, alone, [[7, 8] if b == 1 else [7]], alone_seen, pad_id=0)[0]
                torch.testing.assert_close(after_idle[b], expected[0], atol=1e-4, rtol=1e-4)
            expected = forward_rows(model, alone, [[6]], alone_seen, pad_id=0)[0]
            torch.testing.assert_close(then[b], expected[0], atol=1e-4, rtol=1e-4)
    # The same through generation: questions of 5, 1 and 3 tokens after compressed contexts.
    prompts = [Prompt(row, tail) for row, tail in zip(rows, tails)]
    for spec in ("none", "snapkv(ratio=0.5)+kivi(bits=4,residual=8)"):
        alone = generate(model, Tok(), prompts, parse_policy(spec), max_new_tokens=4, batch_size=1)
        together = generate(model, Tok(), prompts, parse_policy(spec), max_new_tokens=4, batch_size=3)
        assert [r.token_ids for r in together] == [r.token_ids for r in alone], spec
        for a, b in zip(alone, together):
            assert max(abs(x - y) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4, spec
