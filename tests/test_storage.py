"""Token stores: the deployment dtype, eviction without re-quantization, the declared store interface."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from kveval.cache.attention import register_attention
from kveval.cache.compressed import CompressedCache, nominal_bytes_per_token
from kveval.errors import UsageError
from kveval.policies.spec import parse_policy
from kveval.dtypes import checkpoint_kv_dtype, deployment_kv_dtype, parse_kv_dtype
from kveval.stores.base import DenseStore, TokenStore
from kveval.stores.quantized import QuantizedStore
from kveval.stores.lowrank import LowRankStore
from kveval.tensors.quantization import (
    FP8_FORMATS,
    dequantize,
    dequantize_into,
    quantize,
    quantize_fp8,
    quantized_values,
)

from tiny_models import tiny_gemma3, tiny_llama

ROOT = Path(__file__).resolve().parents[1]


def llama_head_dim_64():
    """A tiny Llama with the embedded SmolLM2's head_dim (64), so quant(bits=8)'s default group is one head."""
    register_attention()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=512,
                         attn_implementation="kveval")
    return LlamaForCausalLM(config).eval()


def _prefill(model, spec, tokens=96, kv_dtype=None, **kwargs):
    cache = CompressedCache(model, parse_policy(spec), kv_dtype=parse_kv_dtype(kv_dtype), **kwargs)
    with torch.no_grad():
        model(torch.randint(1, 128, (1, tokens), generator=torch.Generator().manual_seed(0)), cache=cache)
    return cache


# --- item 1: bytes against the deployment dtype --------------------------------------------------

def test_int8_is_0531_of_the_16bit_cache_on_a_float32_model():
    model = llama_head_dim_64()
    assert model.dtype == torch.float32
    stats = _prefill(model, "quant(bits=8)").stats()
    # 64 one-byte codes + fp16 scale + fp16 zero per token and head, against 64 bf16 values: (64 + 4) / 128.
    assert stats.kv_dtype == "bfloat16"
    assert stats.ratio == 68 / 128
    assert stats.nominal_bytes == 96 * nominal_bytes_per_token(model) == 96 * 2 * 2 * 64 * 2


def test_explicit_kv_dtype_overrides_and_none_measures_its_nominal_bytes():
    model = llama_head_dim_64()
    for kv_dtype, width in (("float32", 4), (torch.float16, 2), ("bf16", 2)):
        stats = _prefill(model, "none", kv_dtype=kv_dtype).stats()
        assert stats.kv_bytes == stats.nominal_bytes == 96 * 2 * 2 * 64 * width
    assert _prefill(model, "quant(bits=8)", kv_dtype="float32").stats().ratio == 68 / 256
    with pytest.raises(UsageError, match="kv_dtype='int3'"):
        CompressedCache(model, parse_policy("none"), kv_dtype=parse_kv_dtype("int3"))


def test_full_precision_tokens_are_stored_in_kv_dtype_and_handed_back_in_the_compute_dtype():
    model = tiny_llama()
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for spec in ("none", "kivi(bits=4,group=8,residual=16)", "lowrank(rank=8)"):
            cache = CompressedCache(model, parse_policy(spec))
            model(ids, cache=cache)
            store = cache.layers[0].rows[0].store
            held = {"none": lambda s: s.keys, "kivi(bits=4,group=8,residual=16)": lambda s: s.k.tail,
                    "lowrank(rank=8)": lambda s: s.parts[0].inner.keys}[spec](store)
            assert held.dtype == torch.bfloat16, spec
            keys, values = store.keys_values()
            assert keys.dtype == values.dtype == torch.float32, spec
    # Rounding to bf16 is all that "none" does to the first layer's keys (later layers see rounded attention).
    cache = CompressedCache(model, parse_policy("none"))
    reference = CompressedCache(model, parse_policy("none"), kv_dtype=parse_kv_dtype("float32"))
    with torch.no_grad():
        model(ids, cache=cache)
        model(ids, cache=reference)
    exact, _ = reference.layers[0].rows[0].store.keys_values()
    rounded, _ = cache.layers[0].rows[0].store.keys_values()
    assert torch.equal(rounded, exact.to(torch.bfloat16).float()) and not torch.equal(rounded, exact)


def test_deployment_dtype_defaults():
    model = tiny_llama()
    assert deployment_kv_dtype(model) == torch.bfloat16  # fp32 compute: not a deployment cache dtype
    model.kveval_kv_dtype = torch.float16  # recorded by load_model from the checkpoint
    assert deployment_kv_dtype(model) == torch.float16
    assert deployment_kv_dtype(tiny_llama().to(torch.float16)) == torch.float16
    assert checkpoint_kv_dtype(LlamaConfig(dtype="float16")) == torch.float16
    assert checkpoint_kv_dtype(LlamaConfig(dtype="bfloat16")) == torch.bfloat16
    assert checkpoint_kv_dtype(LlamaConfig(dtype="float32")) == torch.bfloat16
    assert checkpoint_kv_dtype(LlamaConfig()) == torch.bfloat16
    assert parse_kv_dtype("torch.float16") == torch.float16
    with pytest.raises(UsageError, match="use one of"):
        parse_kv_dtype("fp8")


def test_load_model_records_the_checkpoint_dtype_before_loading_in_float32(tmp_path, monkeypatch):
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from kveval.runner.models import load_model

    monkeypatch.setenv("KVEVAL_CACHE", str(tmp_path / "cache"))
    tiny_llama().to(torch.float16).save_pretrained(tmp_path / "ckpt")
    vocab = {"<unk>": 0, "a": 1}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")), unk_token="<unk>",
                            eos_token="<unk>").save_pretrained(tmp_path / "ckpt")
    model, _ = load_model(str(tmp_path / "ckpt"), device="cpu", dtype="float32")
    assert model.dtype == torch.float32 and model.kveval_kv_dtype == torch.float16
    assert nominal_bytes_per_token(model) == 2 * 2 * 2 * 16 * 2


# --- item 3: eviction never re-encodes -------------------------------------------------------------

KIVI = parse_policy("kivi(bits=2,group=8,residual=16)").quantization
QUANT4 = parse_policy("quant(bits=4,group=8)").quantization
FP8_CHANNEL = parse_policy("fp8(axis=channel,group=8,residual=4)").quantization
FP8 = parse_policy("fp8(group=8)").quantization


def _store(policy, kv_dtype=torch.float32):
    return QuantizedStore(policy.key_quant, policy.value_quant, policy.residual_tokens, kv_dtype)


def _evict_one(store, ids, generator, among_first=None):
    """Drop one token per head (a different one in each head), among the first ``among_first`` (default: any).

    ``ids[h]`` tracks the original index of each token head ``h`` keeps.
    """
    length = store.length
    drop = torch.randint(0, among_first or length, (len(ids),), generator=generator)
    index = torch.stack([torch.cat([torch.arange(int(d)), torch.arange(int(d) + 1, length)]) for d in drop])
    store.select(index)
    store.seal()
    return [[row[j] for j in index[h].tolist()] for h, row in enumerate(ids)]


@pytest.mark.parametrize("policy", [KIVI, QUANT4, FP8, FP8_CHANNEL], ids=["kivi", "quant4", "fp8", "fp8-channel"])
def test_reconstruction_after_100_evictions_equals_the_reconstruction_without(policy):
    heads, tokens = 3, 300
    g = torch.Generator().manual_seed(2)
    keys, values = torch.randn(heads, tokens, 16, generator=g), torch.randn(heads, tokens, 16, generator=g)
    reference, evicted = _store(policy), _store(policy)
    for store in (reference, evicted):
        store.append(keys, values)
        store.seal()
    ref_k, ref_v = reference.keys_values()
    ids = [list(range(tokens)) for _ in range(heads)]
    for _ in range(100):
        ids = _evict_one(evicted, ids, g, among_first=100)  # quantized tokens: 280 of 300 are (K and V)
    k, v = evicted.keys_values()
    index = torch.tensor(ids)
    assert k.shape == (heads, tokens - 100, 16)
    assert torch.equal(k, ref_k.gather(1, index[..., None].expand(-1, -1, 16)))
    assert torch.equal(v, ref_v.gather(1, index[..., None].expand(-1, -1, 16)))


def _held(sequence):
    block = sequence.block
    stored = [] if block is None else [t.view(torch.uint8) if t.dtype in FP8_FORMATS.values() else t
                                       for t in (block.data, block.scale, block.zero) if t is not None]
    return stored, sequence.alive, sequence.tail, sequence.count


@pytest.mark.parametrize("policy", [KIVI, QUANT4, FP8_CHANNEL, FP8], ids=["kivi", "quant4", "fp8-channel", "fp8"])
@pytest.mark.parametrize("tokens, keep", [(60, 40), (60, 20), (60, 13), (60, 5), (60, 59), (61, 8), (7, 3)])
@pytest.mark.parametrize("dead", [False, True])
def test_keeping_the_last_tokens_holds_what_selecting_them_holds(policy, tokens, keep, dead):
    """A sliding window's trim keeps each head's last tokens (:meth:`QuantizedStore.keep_last`): without reading
    the device where every slot is alive, it holds the units, codes, scales, dead slots, tail and count that
    :meth:`select` of those slots holds, and reads back the same bits; with dead slots it is that select. Cuts
    inside the tail, at a unit's edge, inside a per-channel group, and of every sealed unit."""
    from kveval.runner.device_waits import OpCounter

    g = torch.Generator().manual_seed(tokens + keep)
    keys, values = torch.randn(2, tokens, 16, generator=g), torch.randn(2, tokens, 16, generator=g)
    trimmed, selected = _store(policy), _store(policy)
    for store in (trimmed, selected):
        store.append(keys, values)
        store.seal()
        if dead:  # evicted slots inside the units: the general path
            store.select(torch.cat([torch.arange(2), torch.arange(3, tokens)]).expand(2, -1))
    n = trimmed.length
    index = torch.arange(n - keep, n).expand(2, -1)
    with OpCounter(torch.nn.Module()) as counter:
        trimmed.keep_last(index)
    selected.select(index)
    if not dead:
        assert counter.counts["waits"] == 0, counter.counts
    for mine, theirs in ((trimmed.k, selected.k), (trimmed.v, selected.v)):
        (m_stored, m_alive, m_tail, m_count), (t_stored, t_alive, t_tail, t_count) = _held(mine), _held(theirs)
        assert m_count == t_count == keep and len(m_stored) == len(t_stored)
        assert all(torch.equal(a, b) for a, b in zip(m_stored, t_stored))
        assert (m_alive is None) == (t_alive is None) and (m_alive is None or torch.equal(m_alive, t_alive))
        assert (m_tail is None) == (t_tail is None) and (m_tail is None or torch.equal(m_tail, t_tail))
    assert all(torch.equal(a, b) for a, b in zip(trimmed.keys_values(), selected.keys_values()))
    assert trimmed.nbytes == selected.nbytes


def test_a_token_once_encoded_never_changes_through_decode_steps_and_evictions():
    """Decode-like: append, seal, evict (heads disagree); every token reads back as itself or as its first encoding."""
    heads, dim = 2, 16
    g = torch.Generator().manual_seed(3)
    originals = torch.randn(heads, 300, dim, generator=g)
    store = _store(KIVI)
    store.append(originals[:, :64], originals[:, :64])
    store.seal()
    ids = [list(range(64)) for _ in range(heads)]
    first_encoding = {}
    for step in range(64, 300):
        store.append(originals[:, step:step + 1], originals[:, step:step + 1])
        store.seal()
        ids = [row + [step] for row in ids]
        if step % 2:
            ids = _evict_one(store, ids, g)
        keys, _ = store.keys_values()
        for h in range(heads):
            for j, t in enumerate(ids[h]):
                now = keys[h, j]
                if torch.equal(now, originals[h, t]):
                    assert (h, t) not in first_encoding  # a token never returns to full precision
                    continue
                assert torch.equal(first_encoding.setdefault((h, t), now), now)
    assert len(first_encoding) > 100  # the check saw many encoded tokens


@pytest.mark.parametrize("policy", [KIVI, QUANT4, FP8_CHANNEL, FP8, parse_policy("quant(bits=8,group=4,symmetric=true)").quantization],
                         ids=["kivi", "quant4", "fp8-channel", "fp8", "int8-symmetric"])
@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16])
def test_sealing_stores_together_encodes_each_exactly_as_alone(policy, kv_dtype):
    """``QuantizedStore.seal_all`` (one layer's rows) encodes the rows' aged slots side by side in one call: each
    store then holds, bit for bit, what sealing it alone gives (codes, scales, zero points, tail, liveness), reads
    back the same K/V and counts the same bytes; through a prefill of rows of different lengths (one too short to
    age any slot, one whose heads evicted different slots) and decode steps after it."""
    generator = torch.Generator().manual_seed(7)
    lengths = [45, 30, 3, 61]

    def stores():
        made = []
        for n in lengths:
            store = _store(policy, kv_dtype)
            x = torch.randn(2, n, 16, generator=torch.Generator().manual_seed(n))
            store.append(x, x * 2)
            made.append(store)
        return made

    alone, together = stores(), stores()
    for step in range(12):
        if step == 1:  # the longest row's heads evict different sealed slots: its units then hold dead slots
            index = torch.stack([torch.arange(0, 60), torch.arange(1, 61)])
            alone[3].select(index)
            together[3].select(index)
        for store in alone:
            store.seal()
        QuantizedStore.seal_all(together)
        for a, b in zip(alone, together):
            for mine, theirs in ((a.k, b.k), (a.v, b.v)):
                assert (mine.block is None) == (theirs.block is None)
                if mine.block is not None:
                    for name in ("data", "scale", "zero"):
                        x, y = getattr(mine.block, name), getattr(theirs.block, name)
                        assert (x is None and y is None) or torch.equal(x.view(torch.uint8) if x.dtype.itemsize == 1 else x,
                                                                       y.view(torch.uint8) if y.dtype.itemsize == 1 else y)
                    assert mine.block.shape == theirs.block.shape
                for x, y in ((mine.tail, theirs.tail), (mine.alive, theirs.alive), (mine.tail_alive, theirs.tail_alive)):
                    assert (x is None and y is None) or torch.equal(x, y)
            for x, y in zip(a.keys_values(), b.keys_values()):
                assert torch.equal(x, y)
            assert a.nbytes == b.nbytes and a.length == b.length
        new = torch.randn(2, 1, 16, generator=generator)  # a decode step: one token each
        for a, b in zip(alone, together):
            a.append(new, -new)
            b.append(new, -new)
    assert sum(s.k.block is not None for s in together) >= 3  # most rows encoded some slots


def test_a_channel_group_keeps_its_bytes_until_every_slot_is_evicted():
    store = _store(KIVI)
    x = torch.randn(2, 40, 16, generator=torch.Generator().manual_seed(4))
    store.append(x, x)
    store.seal()  # keys: 24 aged tokens = 3 groups of 8; values: 24 tokens per token
    assert store.k.block.units == 3
    full, group_bytes = store.k.nbytes, store.k.block.nbytes // 3
    keep = torch.arange(7, 40).expand(2, -1)  # 7 of the first group's 8 slots go
    store.select(keep)
    assert store.k.block.units == 3 and store.k.nbytes == full  # one live slot keeps the whole group
    store.select(torch.arange(1, 33).expand(2, -1))
    assert store.k.block.units == 2 and store.k.nbytes == full - group_bytes
    assert store.v.block.units == 16  # values per token: every evicted token's bytes go at once


def test_heads_that_keep_different_tokens_pad_to_the_largest_and_count_it():
    policy = parse_policy("quant(bits=4,group=8,residual=4)").quantization
    store = _store(policy)
    x = torch.randn(2, 10, 16, generator=torch.Generator().manual_seed(5))
    store.append(x, x)
    store.seal()  # 6 tokens quantized, 4 in the full-precision tail
    store.select(torch.tensor([[0, 1, 2, 3], [6, 7, 8, 9]]))  # head 0 keeps quantized tokens, head 1 its tail
    quantized_token, tail_token = 16 // 2 + 2 * (2 + 2), 16 * 4  # packed nibbles + scale/zero of 2 groups; fp32 values
    # Rectangular over heads: each head pads to 4 quantized and 4 full-precision slots, and the bytes say so.
    assert store.length == 4 and store.nbytes == 2 * 2 * 4 * (quantized_token + tail_token)
    k, _ = store.keys_values()
    assert torch.equal(k[0], dequantize(quantize(x[:, :6], 4, "token", 8), torch.float32)[0, :4])
    assert torch.equal(k[1], x[1, 6:])
    store.append(x[:, :1], x[:, :1])
    store.seal()  # head 1's token 6 is quantized now, into the slot head 0 leaves dead
    k, _ = store.keys_values()
    assert store.length == 5 and store.k.block.units == 4 and store.k.tail_slots == 4
    assert torch.equal(k[1, 0], dequantize(quantize(x[:, 6:7], 4, "token", 8), torch.float32)[1, 0])
    assert torch.equal(k[1, 1:], torch.cat([x[1, 7:], x[1, :1]]))


def test_masked_slots_do_not_widen_a_group_range():
    x = torch.tensor([[[0.0], [1.0], [100.0], [2.0]]]).expand(1, 4, 1).contiguous()
    valid = torch.tensor([[True, True, False, True]])
    block = quantize(x, 8, "channel", 4, valid=valid)
    restored = dequantize(block, torch.float32)
    assert float(block.scale.float().max()) == pytest.approx(2 / 255, rel=1e-3)
    assert torch.allclose(restored[0, [0, 1, 3], 0], torch.tensor([0.0, 1.0, 2.0]), atol=0.01)


def _reference_dequantize(block, dtype):
    """Codes unpacked bit by bit (shift and mask, least significant code first in a byte), then
    ``codes x scale + zero`` in float32 (codes offset by ``2**(bits-1)`` when symmetric), rounded to ``dtype``."""
    heads, tokens, dim = block.shape
    grouped = (heads, tokens, dim // block.group, block.group) if block.axis == "token" else \
        (heads, tokens // block.group, dim, block.group)
    if block.fp8 is not None:
        g = block.data.float() * block.scale.float()
    else:
        per_byte = 8 // block.bits
        codes = torch.stack([(block.data >> (i * block.bits)) & ((1 << block.bits) - 1) for i in range(per_byte)], dim=-1)
        codes = codes.reshape(*block.data.shape[:-1], -1)[..., :math.prod(grouped[2:])].reshape(grouped).float()
        g = (codes - 2 ** (block.bits - 1)) * block.scale.float() if block.zero is None else \
            codes * block.scale.float() + block.zero.float()
    if block.axis == "channel":
        g = g.transpose(-1, -2)
    return g.reshape(heads, tokens, dim).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dequantizing_into_a_strided_scratch_gives_the_bits_of_unpacking_code_by_code(dtype):
    torch.manual_seed(0)
    x = torch.randn(6, 64, 24) * torch.linspace(0.1, 8, 24)  # channels of different ranges
    blocks = [quantize(x, bits, axis, group, symmetric=symmetric)
              for bits in (2, 4, 8) for axis, group in (("token", 8), ("token", 24), ("channel", 16))
              for symmetric in (False, True)]
    blocks += [quantize_fp8(x, fmt, "token", 8) for fmt in ("e4m3", "e5m2")]
    for block in blocks:
        expected = _reference_dequantize(block, dtype)
        assert torch.equal(dequantize(block, dtype), expected)
        scratch = torch.full((3, 2, 80, 24), float("nan"), dtype=dtype)  # rows x heads, 16 slots of room
        written = dequantize_into(block, scratch[:, :, :64].view(6, 64, 24))
        assert torch.equal(scratch[:, :, :64].reshape(6, 64, 24), expected)
        assert written.data_ptr() == scratch.data_ptr() and scratch[:, :, 64:].isnan().all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_decode_step_reading_its_tokens_back_gives_the_bits_of_quantize_and_dequantize(dtype):
    """``quantized_values`` (no packing, no uint8 round trip) equals ``dequantize(quantize(...))`` bit for bit, for
    every width, axis, symmetry and FP8 format, constant groups included."""
    torch.manual_seed(1)
    x = (torch.randn(6, 32, 24) * torch.linspace(0.1, 8, 24)).to(dtype)
    x[1] = 0.0  # whole groups of zeros
    x[2, :, :8] = 0.25  # constant per-token groups
    x[3, :, 8:16] = torch.linspace(-0.001, 3.0, 8)  # a small negative: symmetric codes round it to -0.0
    for bits, axis, group, symmetric, fp8 in [(b, a, g, s, None) for b in (2, 4, 8) for a, g in (("token", 8), ("channel", 16))
                                              for s in (False, True)] + [(8, a, g, False, f) for f in ("e4m3", "e5m2")
                                                                          for a, g in (("token", 8), ("channel", 16))]:
        block = quantize_fp8(x, fp8, axis, group) if fp8 else quantize(x, bits, axis, group, symmetric=symmetric)
        for out in (torch.float32, torch.bfloat16):
            got, expected = quantized_values(x, bits, axis, group, symmetric, fp8, out), dequantize(block, out)
            assert got.dtype == out and torch.equal(got, expected), (bits, axis, symmetric, fp8, out)
            assert torch.equal(got.signbit(), expected.signbit()), (bits, axis, symmetric, fp8, out)  # zeros too


def test_reading_codes_back_converts_no_scale_or_zero_point():
    """Dequantizing (every decode step of a layer held as codes) and reading a step's tokens back multiply and add
    the stored float16 scales and zero points into float32 operands, which promotes them exactly inside the
    kernel: no conversion kernel per tensor (two per side and layer and step before, 180 of 2,128 kernels per
    decode step of quant(bits=8) held as codes on SmolLM2 at batch 8). The bits are those of converting first
    (tests above, and the codes of every width, axis and format)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    converted = []

    class Conversions(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func.overloadpacket.__name__ == "_to_copy" and args[0].dtype == torch.float16:
                converted.append(args[0].shape)
            return func(*args, **(kwargs or {}))

    x = torch.randn(3, 32, 16, generator=torch.Generator().manual_seed(4))
    blocks = [quantize(x, 4, "token", 8), quantize(x, 2, "channel", 8), quantize(x, 8, "token", 16, symmetric=True),
              quantize_fp8(x, "e4m3", "token", 8)]
    with Conversions():
        for block in blocks:
            dequantize_into(block, torch.empty(3, 32, 16))
        for bits, axis, symmetric, fp8 in ((4, "token", False, None), (8, "channel", True, None), (8, "token", False, "e5m2")):
            quantized_values(x, bits, axis, 8, symmetric, fp8, torch.float32)
    assert converted == []


@pytest.mark.parametrize("fmt", [None, "e4m3", "e5m2"])
def test_a_group_of_zeros_or_of_one_value_reads_back_as_it_was(fmt):
    """A scale below float16's smallest positive value used to round to 0, and the codes became 0/0: an FP8 group
    of zeros read back as NaN (which attention spreads to every query that sees it), and integer codes rested on
    how NaN casts to uint8, which C++ leaves undefined."""
    x = torch.zeros(2, 4, 16)
    x[1, :, :8] = 3e-6  # one value, far below float16's smallest normal
    x[1, :, 8:] = torch.linspace(1e-6, 2e-6, 8)  # a range of 1e-6: a scale of 4e-9 at 8 bits
    block = quantize_fp8(x, fmt, "token", 8) if fmt else quantize(x, 8, "token", 8)
    restored = dequantize(block, torch.float32)
    assert not restored.isnan().any() and (block.scale.float() > 0).all()
    assert torch.equal(restored[0], x[0])
    # int8: within half a step of 2**-24; FP8: within half its spacing (2 mantissa bits in e5m2: 12.5%)
    assert torch.allclose(restored[1], x[1], rtol=0.125 if fmt else 0, atol=0 if fmt else 3e-8)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_an_fp8_group_whose_scale_is_float16_subnormal_saturates_instead_of_overflowing(fmt):
    """A scale in float16's subnormal range rounds by up to a third: 1.4 x 2**-24 becomes 2**-24, and the group's
    largest value lands at 1.4 x the format's largest, which the cast turned into inf in e5m2 (torch 2.13's CPU
    cast to e4m3 saturated a tensor of them; a cast that does not gives NaN)."""
    largest = torch.finfo(FP8_FORMATS[fmt]).max
    x = torch.full((1, 2, 8), largest * 1.4 * 2**-24)
    x[0, 1] = torch.linspace(-1.0, 1.0, 8)  # an ordinary group beside it keeps its bits
    block = quantize_fp8(x, fmt, "token", 8)
    restored = dequantize(block, torch.float32)
    assert restored.isfinite().all()
    assert torch.equal(restored[0, 0], torch.full((8,), largest * 2**-24))  # saturated: the format's largest
    assert torch.equal(restored[0, 1], quantized_values(x, 8, "token", 8, False, fmt, torch.float32)[0, 1])
    assert torch.allclose(restored[0, 1], x[0, 1], rtol=0.13)


# --- the store interface and the import graph ------------------------------------------------------

def test_every_store_implements_the_declared_interface():
    model = tiny_llama()
    stores = [CompressedCache(model, parse_policy(spec)).new_store(0, torch.float32)
              for spec in ("none", "kivi(bits=4,group=8,residual=4)", "lowrank(rank=8)", "lowrank(rank=8)+quant(bits=8,group=8)")]
    assert [type(s) for s in stores] == [DenseStore, QuantizedStore, LowRankStore, LowRankStore]
    assert all(isinstance(s, TokenStore) for s in stores)
    with pytest.raises(TypeError):
        type("Incomplete", (TokenStore,), {"append": lambda self, k, v: None})()


def test_calibration_does_not_import_the_cache():
    """kveval.calibration.kv calibrates in transformers' own cache layers: no cache -> policies -> lowrank -> cache loop."""
    code = ("import sys; sys.path.insert(0, 'tests'); from tiny_models import tiny_gemma3; "
            "from kveval.calibration.kv import calibrate, read_calibration_text; "
            "c = calibrate(tiny_gemma3(), read_calibration_text(), 64); "
            "assert c.tokens == 64 and c.num_layers == 4, c.tokens; "
            "print('kveval.cache.compressed' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "False"


def test_calibration_reads_every_token_of_sliding_layers():
    from kveval.calibration.kv import _collect_kv

    model = tiny_gemma3(sliding_window=16)
    ids = torch.randint(1, 128, (1, 40), generator=torch.Generator().manual_seed(7))
    reference = CompressedCache(model, parse_policy("none"), kv_dtype=parse_kv_dtype("float32"))
    with torch.no_grad():
        model(ids, cache=reference)
    for (k, v), layer in zip(_collect_kv(model, ids)[0], reference.layers):
        assert k.shape[1] == 40
        held_k, held_v = layer.rows[0].store.keys_values()
        n = held_k.shape[1]  # kveval's sliding layers trim to their window: compare what they still hold
        assert torch.equal(k[:, -n:], held_k) and torch.equal(v[:, -n:], held_v)


def test_the_torch_free_cache_dtype_table_is_torch_s():
    """The analysis commands size a run's cache from kveval.dtypes without torch; its bytes and names are those
    storage stores in (one table: storage builds its torch dtypes from it)."""
    from kveval.dtypes import CACHE_DTYPE_BYTES, CACHE_DTYPE_NAMES
    from kveval.dtypes import dtype_name, kv_dtypes

    assert set(CACHE_DTYPE_NAMES) == set(kv_dtypes())
    for alias, dtype in kv_dtypes().items():
        assert dtype_name(dtype) == CACHE_DTYPE_NAMES[alias]
        assert torch.empty(0, dtype=dtype).element_size() == CACHE_DTYPE_BYTES[CACHE_DTYPE_NAMES[alias]]
