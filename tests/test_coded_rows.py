"""CodedRows: a batch's quantized K (or V) of one layer reads back exactly as each row's QuantizedSequence."""

import pytest
import torch

from kveval.cache.coded_rows import CodedRows, seal_together
from kveval.errors import UsageError
from kveval.stores.quantized import QuantizedSequence, encode
from kveval.tensors.quantization import TensorQuant

KV, COMPUTE = torch.bfloat16, torch.float32
STEPS = 70

CASES = {  # name: (quant, residual, heads, head_dim)
    "int8-token": (TensorQuant(8, "token", 32), 8, 2, 32),
    "int4-token-g32": (TensorQuant(4, "token", 32), 16, 2, 64),
    "int2-channel-g32-kivi": (TensorQuant(2, "channel", 32), 32, 3, 64),
    "int4-symmetric": (TensorQuant(4, "token", 32, symmetric=True), 0, 2, 32),
    "fp8-e4m3-token": (TensorQuant(8, "token", 32, fp8="e4m3"), 4, 2, 32),
}


def _step_mask(step: int, batch: int) -> torch.Tensor:
    """``[B, q]`` real tokens of decode step ``step``: mostly one real token per row, sometimes a row sits out,
    one step of three tokens for every row, one of three with rows appending different counts."""
    if step == 40:
        return torch.ones(batch, 3, dtype=torch.bool)
    if step == 41:
        return torch.tensor([[True, False, True], [False, False, False], [True, True, True], [False, True, False]])[:batch]
    real = torch.ones(batch, 1, dtype=torch.bool)
    if step % 9 == 4:
        real[step % batch] = False
    return real


def _prefilled(quant, residual, heads, dim, prompts, generator) -> list[QuantizedSequence]:
    refs = []
    for n in prompts:
        ref = QuantizedSequence(quant, residual, KV, COMPUTE)
        if n:
            ref.append(torch.randn(heads, n, dim, generator=generator))
            ref.seal()
        refs.append(ref)
    return refs


def _check(rows: CodedRows, refs: list[QuantizedSequence]) -> None:
    got = rows.read(COMPUTE)
    assert got.shape == (len(refs), rows.heads, max(r.length for r in refs), rows.dim)
    assert rows.lengths == [r.length for r in refs]
    for b, ref in enumerate(refs):
        n = ref.length
        if n:
            assert torch.equal(got[b, :, :n], ref.materialize()), f"row {b} differs at length {n}"
        assert not got[b, :, n:].any(), f"row {b}: padding slots are not zero"
    assert rows.nbytes == sum(r.nbytes for r in refs)
    assert rows.held_bytes >= rows.nbytes


def _decode(name: str, prompts: list[int], seed: int = 0):
    """Prefill rows of ``prompts`` tokens, then decode STEPS steps in CodedRows and in a reference per row,
    checking after every step. Returns the CodedRows and how often its block's storage moved."""
    quant, residual, heads, dim = CASES[name]
    generator = torch.Generator().manual_seed(seed)
    refs = _prefilled(quant, residual, heads, dim, prompts, generator)
    rows = CodedRows.from_sequences(refs)
    _check(rows, refs)
    pointers = []
    for step in range(STEPS):
        real = _step_mask(step, len(prompts))
        x = torch.randn(len(prompts), heads, real.shape[1], dim, generator=generator)
        counts = real.sum(dim=1).tolist()
        rows.append(x.to(KV), real, counts)
        for b, ref in enumerate(refs):
            if counts[b]:
                ref.append(x[b][:, real[b]])
                ref.seal()
        _check(rows, refs)
        if rows.block is not None:
            pointers.append(rows.block.data.data_ptr())
    moves = sum(a != b for a, b in zip(pointers, pointers[1:]))
    return rows, refs, moves


@pytest.mark.parametrize("name", list(CASES))
def test_batched_rows_read_back_as_each_rows_sequence(name):
    rows, refs, moves = _decode(name, [37, 5, 64, 0])
    quant, residual, _, _ = CASES[name]
    unit = 1 if quant.axis == "token" else quant.group
    assert any(rows.units), "the decode never sealed a unit: the test would not exercise the codes"
    assert all(t < residual + unit + 3 for t in rows.tails)  # the tails stay bounded: tokens do age
    assert moves <= 2, f"the block's storage moved {moves} times in {STEPS} steps"


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("v_residual", ["same", "other"])
def test_k_and_v_sealed_together_read_back_as_each_rows_sequences(name, v_residual, monkeypatch):
    """``seal_together``: K and V of one encoding and window are encoded as one tensor (one ``encode`` per seal, not
    two), and each side still holds each row's own codes, over mixed steps (rows sitting out, several tokens);
    sides that age differently seal apart."""
    import kveval.cache.coded_rows as coded_rows

    calls = []
    monkeypatch.setattr(coded_rows, "encode", lambda quant, x: calls.append(x.shape) or encode(quant, x))
    quant, residual, heads, dim = CASES[name]
    other = residual if v_residual == "same" else residual + quant.group
    generator = torch.Generator().manual_seed(3)
    prompts = [37, 5, 64, 0]
    refs = {"k": _prefilled(quant, residual, heads, dim, prompts, generator),
            "v": _prefilled(quant, other, heads, dim, prompts, generator)}
    sides = {kind: CodedRows.from_sequences(refs[kind]) for kind in refs}
    seals = expected = 0
    for step in range(STEPS):
        real = _step_mask(step, len(prompts))
        counts = real.sum(dim=1).tolist()
        units = [list(side.units) for side in sides.values()]
        for kind, side in sides.items():
            x = torch.randn(len(prompts), heads, real.shape[1], dim, generator=generator)
            side.append(x.to(KV), real, counts, seal=False)
            for b, ref in enumerate(refs[kind]):
                if counts[b]:
                    ref.append(x[b][:, real[b]])
                    ref.seal()
        groups = [len(side._aged()[1]) for side in sides.values()]  # encodings each side's seal needs alone
        expected += groups[0] if v_residual == "same" else sum(groups)
        seal_together(sides["k"], sides["v"])
        seals += sum(u != list(side.units) for u, side in zip(units, sides.values()))
        for kind, side in sides.items():
            _check(side, refs[kind])
    assert seals > 0 and len(calls) == expected


@pytest.mark.parametrize("name", ["int4-token-g32", "int2-channel-g32-kivi"])
def test_rows_of_equal_length_take_the_slice_paths_exactly(name):
    _decode(name, [20, 20, 20], seed=1)


def test_read_into_a_scratch_returns_a_view_of_it_with_the_same_values():
    rows, _, _ = _decode("int4-token-g32", [37, 5, 64, 0])
    scratch = torch.full((4, rows.heads, rows.width + 50, rows.dim), float("nan"))
    view = rows.read(COMPUTE, out=scratch)
    assert view.data_ptr() == scratch.data_ptr() and view.shape[2] == rows.width
    assert torch.equal(view, rows.read(COMPUTE))
    assert torch.isnan(scratch[:, :, rows.width:]).all()  # nothing written past the width


def test_codes_are_held_at_their_packed_size_not_dequantized():
    rows, refs, _ = _decode("int2-channel-g32-kivi", [37, 5, 64, 0])
    dim, tail_bytes = rows.dim, sum(rows.tails) * rows.heads * rows.dim * 2  # bf16 tail
    # a unit of one head: 32 tokens x dim channels at 2 bits, plus an fp16 scale and zero per channel
    assert rows.nbytes - tail_bytes == sum(rows.units) * rows.heads * (32 * dim * 2 // 8 + 2 * dim * 2)
    assert rows.nbytes < sum(r.length for r in refs) * rows.heads * dim * 2  # under the bf16 cache, residual included


def test_rows_with_evicted_slots_are_refused():
    quant, residual, heads, dim = CASES["int2-channel-g32-kivi"]
    (ref,) = _prefilled(quant, residual, heads, dim, [70], torch.Generator().manual_seed(2))
    ref.select(torch.arange(0, 70, 2).expand(heads, -1))  # half of each sealed group dies: the group stays
    assert ref.alive is not None
    with pytest.raises(UsageError, match="evicted"):
        CodedRows.from_sequences([ref])


def test_rows_holding_nothing_need_their_shape_named():
    quant, residual, heads, dim = CASES["int8-token"]
    empty = [QuantizedSequence(quant, residual, KV, COMPUTE) for _ in range(2)]
    with pytest.raises(UsageError, match="heads= and dim="):
        CodedRows.from_sequences(empty)
    rows = CodedRows.from_sequences(empty, heads=heads, dim=dim)
    x = torch.randn(2, heads, 12, dim)
    rows.append(x.to(KV), torch.ones(2, 12, dtype=torch.bool), [12, 12])
    for b, ref in enumerate(empty):
        ref.append(x[b])
        ref.seal()
    _check(rows, empty)


def test_read_in_a_sixteen_bit_compute_dtype_matches_the_rows_sequences():
    rows, refs, _ = _decode("int4-token-g32", [37, 5, 64, 0], seed=3)
    got = rows.read(torch.bfloat16)
    assert got.dtype == torch.bfloat16
    for b, ref in enumerate(refs):
        ref.compute_dtype = torch.bfloat16
        assert torch.equal(got[b, :, :ref.length], ref.materialize())
