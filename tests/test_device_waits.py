"""A batch costs a GPU no work per row: the prefill's tokens reach the cache for the whole batch at once, and no
forward makes the host wait for the device once per row.

On a GPU a boolean index (``nonzero``), ``int(t)`` or ``tolist`` waits for every kernel queued before it; once per
row and layer, a batch of 32 runs at the host's pace. The counts (:mod:`kveval.runner.device_waits`) are exact on a CPU.
The packed prefill (:meth:`BatchBuffer.packed`) must hold the bits that appending row by row held.
"""

from __future__ import annotations

import pytest
import torch

from kveval.cache.layers import CompressedLayer
from kveval.policies.spec import parse_policy
from kveval.runner.device_waits import OpCounter
from kveval.runner.generation import generate
from kveval.stores.base import DenseStore
from kveval.tensors.batch_buffer import PAD_POSITION, BatchBuffer, real_runs

from cache_runs import fingerprint, random_prompts
from tiny_models import Tok, tiny_gemma3, tiny_llama, tiny_model

#: Contexts of three lengths and questions of two: every batch of three or more is left-padded in both forwards.
SIZES = [(41, 4), (52, 6), (23, 4), (35, 6), (27, 4), (44, 4)]
#: Policies whose rows hold dense stores (packed at the prefill), and policies whose stores encode (row by row).
DENSE = ["none", "window(size=16)", "h2o(ratio=0.5,decode_budget=20)", "snapkv(ratio=0.5)", "random(ratio=0.5)",
         "tova(ratio=0.5,decode_budget=20)"]
ENCODED = ["kivi(bits=2,group=4,residual=4)", "snapkv(ratio=0.5)+quant(bits=4,group=8)", "lowrank(rank=8)",
           "h2o(ratio=0.5,adaptive=true,decode_budget=20)"]


def test_real_runs_reads_each_rows_contiguous_columns():
    real = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [1, 1, 0, 0, 0], [0, 1, 0, 1, 0],
                         [0, 0, 0, 0, 1]], dtype=torch.bool)
    counts, columns = real_runs(real)
    assert counts == [3, 5, 0, 2, 2, 1]
    assert columns == [slice(2, 5), slice(0, 5), slice(0, 0), slice(0, 2), None, slice(4, 5)]
    assert real_runs(torch.ones(2, 0, dtype=torch.bool)) == ([0, 0], [slice(0, 0)] * 2)


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, torch.float32])
def test_a_packed_buffer_holds_the_bits_of_rows_written_one_by_one(kv_dtype):
    """Rows of every kind of run (left-, right- and un-padded, empty) from keys in a transposed layout, as a
    model's projections give them: the same buffer, stores and positions as a store per row and ``write_row``."""
    batch, heads, q, dim = 5, 3, 9, 4
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(batch, q, heads, dim, generator=generator).transpose(1, 2)
    values = torch.randn(batch, q, heads, dim + 2, generator=generator).transpose(1, 2)
    positions = torch.arange(q).expand(batch, -1) + torch.tensor([0, 7, 3, 0, 11])[:, None]
    runs = ((5, 9), (0, 9), (9, 9), (0, 3), (2, 8))
    packed, stored_keys, stored_values, held = BatchBuffer.packed(keys, values, positions, runs, kv_dtype)

    rowwise = BatchBuffer(batch, heads, dim, dim + 2, keys.dtype, keys.device)
    for b, (start, stop) in enumerate(runs):
        c = slice(start, stop)
        store = DenseStore(kv_dtype, keys.dtype)
        store.append(keys[b][:, c], values[b][:, c])
        n = store.length
        if n:
            rowwise.write_row(b, 0, *store.keys_values(), positions[b, c].expand(heads, -1))
            assert torch.equal(stored_keys[b, :, :n], store.keys) and torch.equal(stored_values[b, :, :n], store.values)
            assert torch.equal(held[b, :, :n], positions[b, c].expand(heads, -1))
    assert packed.lengths == rowwise.lengths == [4, 9, 0, 3, 6] and packed.width == rowwise.width == 9
    for got, expected in zip(packed.views(), rowwise.views()):
        assert got.dtype == expected.dtype and torch.equal(got, expected)
    assert stored_keys.dtype == kv_dtype and bool((held[2] == PAD_POSITION).all()) and bool((stored_keys[2] == 0).all())
    assert packed.capacity >= packed.width + 64  # room to grow: the question and the decode steps append in place


def _generate(model, spec, monkeypatch, packed=True, eos=None, mode="context", sizes=SIZES):
    """Fingerprints of one batch of ``sizes`` prompts; ``packed=False`` appends the prefill row by row."""
    taken = []
    original = CompressedLayer._pack_first_tokens

    def counted(self, *args):
        taken.append(original(self, *args))
        return taken[-1]

    with monkeypatch.context() as patch:
        patch.setattr(CompressedLayer, "_pack_first_tokens", counted if packed else lambda self, *args: False)
        model.generation_config.eos_token_id = eos
        try:
            results = generate(model, Tok(), random_prompts(sizes, seed=3), parse_policy(spec), max_new_tokens=6,
                               batch_size=len(sizes), mode=mode)
        finally:
            model.generation_config.eos_token_id = None
    # Every layer's prefill was packed where the rows hold dense stores, none where they encode.
    assert not packed or (len(taken) == model.config.num_hidden_layers and set(taken) == {spec in DENSE})
    return [fingerprint(r) for r in results]


@pytest.mark.parametrize("spec", DENSE + ENCODED)
def test_a_packed_prefill_gives_the_bits_of_appending_row_by_row(spec, monkeypatch):
    """Tokens, log-probabilities, bytes and kept tokens, in both modes, and with an EOS that ends rows at
    different steps. Stores that encode (quantized, low-rank, per-head) append row by row either way."""
    model = tiny_llama()
    free = _generate(model, spec, monkeypatch, mode="query")
    eos = next(t for t in sorted({t for row in free for t in row[1][1:]}) if 1 <= sum(t in row[1] for row in free) < len(free))
    for kwargs in ({}, {"mode": "query"}, {"eos": eos, "mode": "query"}):
        assert _generate(model, spec, monkeypatch, **kwargs) == _generate(model, spec, monkeypatch, packed=False, **kwargs)


def test_a_packed_prefill_of_sliding_layers_gives_the_bits_of_appending_row_by_row(monkeypatch):
    model = tiny_gemma3()  # contexts longer than its window of 16: the sliding layers trim after the prefill
    for spec in ("none", "snapkv(ratio=0.5)"):
        assert _generate(model, spec, monkeypatch) == _generate(model, spec, monkeypatch, packed=False)


def _phases(model, spec: str, sizes, quantized_decode: str = "auto") -> list:
    """Counts per forward of a second, warm run (tensors made once per shape are made by the first)."""
    for _ in range(2):
        with OpCounter(model) as counter:
            generate(model, Tok(), random_prompts(sizes, seed=3), parse_policy(spec), max_new_tokens=5, batch_size=len(sizes),
                     quantized_decode=quantized_decode)
    return counter.phases()


@pytest.mark.parametrize("spec, quantized_decode", [("none", "auto"), ("window(size=16)", "auto"),
                                                    ("h2o(ratio=0.5,decode_budget=20)", "auto"),
                                                    ("kivi(bits=2,group=4,residual=4)", "buffer"),
                                                    ("kivi(bits=2,group=4,residual=4)", "codes"),
                                                    ("quant(bits=8,group=8)", "codes")])
def test_a_batch_makes_no_device_wait_and_launches_no_kernel_per_row(spec, quantized_decode):
    """Twice the rows (the same three prompt lengths, twice): the same host waits and uploads in every forward
    (the prefill, the question, each decode step), and the same kernels in the decode steps, and for ``none`` in
    the prefill and the question too. Compression still selects and encodes row by row at the prefill's end, and
    the question's forward rewrites the rows it changed in the batch buffer. The last phase runs to the end:
    every row's store catches up with the steps done on the buffer, row by row. Before the prefill was packed,
    each row of each layer cost three boolean indexes (a wait each) and about ten kernels, and each decode step
    read every row's token and log-probability from the device one by one. Quantized layers held as codes (the
    default on CUDA) write a step's tokens at each row's own tail slot by an index made on the host."""
    model = tiny_llama()
    three, six = (_phases(model, spec, sizes, quantized_decode) for sizes in (SIZES[:3], SIZES[:3] * 2))
    assert len(three) == len(six) == 6  # prefill, question, four decode steps (the last one to the end)
    layers = model.config.num_hidden_layers
    evicts = None if parse_policy(spec).selection is None else parse_policy(spec).selection.decode_budget
    for phase, (a, b) in enumerate(zip(three, six)):
        assert b["waits"] == a["waits"] and b["uploads"] == a["uploads"], (phase, a, b)
        if spec == "none" and phase < 5:
            assert b["ops"] == a["ops"], (phase, a, b)
        if spec == "none" and phase == 1:  # the question: a padded question's slots come from the host, not nonzero
            assert b["waits"] == 1, b  # the first token's read: without selection the heads share slots, known
        elif 1 < phase < 5:  # less than a kernel per added row and layer (a residual's aged slots may group apart)
            assert b["ops"] - a["ops"] < 3 * layers, (phase, a, b)
        if 1 < phase < 5 and evicts is None:  # a step that evicts nothing reads the device once: the new tokens
            assert b["waits"] == 1, (phase, b)


@pytest.mark.parametrize("name, spec, waits", [("gemma3", "none", 1), ("gemma3", "quant(bits=8,group=8)", 1),
                                               ("llama", "random(ratio=0.5,decode_budget=20)", 1),
                                               ("llama", "knorm(ratio=0.5,decode_budget=20)", 1),
                                               ("llama4", "none", 1), ("llama", "kvquant(bits=4)", 1),
                                               ("gemma3", "kvquant(bits=4)", 1)])
@pytest.mark.usefixtures("calibration_cache")
def test_a_decode_step_keeping_a_window_or_a_budget_scored_per_layer_reads_the_device_once(name, spec, waits):
    """Gemma 3's sliding layers (a window of 16 here, prompts past it) keep each row's newest tokens, slots known
    from the rows' lengths, and see them all (a mask from the lengths); a decode budget whose scores do not stack
    across layers (the random control's, key norms) drops each row's last-ranked slot by one stable sort. Neither
    reads the device: a decode step waits once, for its new tokens. The code before waited twice per sliding layer
    to rank by position and once more to ask whether the heads share slots (10 waits a step here), and twice per
    layer under those budgets (whether the lowest score is unique; the first slot any row dropped). Llama 4, whose
    attention passes no positions to the cache, decoded row by row (18 waits a step for 3 rows and 2 layers here);
    from the positions its driver declares, on the buffer, and its chunked layer's mask from positions reads
    nothing where no policy selects tokens per head (it read whether the heads share slots). KVQuant read each layer's largest position to size its RoPE table; the
    layer knows a bound on the host when the positions are kveval's own (counted, or declared by its driver)."""
    model = {"gemma3": lambda: tiny_gemma3(sliding_window=16), "llama": tiny_llama,
             "llama4": lambda: tiny_model("llama4")}[name]()
    phases = _phases(model, spec, [(30, 4), (23, 4), (27, 4)])
    assert len(phases) == 6
    for phase in phases[2:5]:
        assert phase["waits"] == waits, phases


@pytest.mark.parametrize("rows", [3, 6])
def test_sliding_layers_trim_the_prefill_to_their_window_with_reads_per_layer_not_per_row(rows):
    """At the prefill's end each sliding layer keeps what the next query can see (a window of 16 here, prompts
    past it). The rows' counts of tokens kept, and whether their positions ascend, come in one read per layer, and
    whether their positions are consecutive (so the batch decodes on its buffer) in one more: as many waits for 6
    rows as for 3. The code before read four times per row and layer (its largest position, whether all stay,
    which stay, whether the index is every slot) and once per row for the consecutive check: this prefill (3
    sliding layers, 4 layers) waited 40 times for 3 rows and 76 for 6; now 10 for either."""
    model = tiny_gemma3(sliding_window=16)
    lengths = [(30, 4), (23, 4), (27, 4), (41, 4), (19, 4), (33, 4)][:rows]
    prefill = _phases(model, "none", lengths)[0]
    sliding = sum(1 for kind in model.config.layer_types if kind == "sliding_attention")
    assert prefill["waits"] <= 2 * sliding + len(model.config.layer_types), prefill


@pytest.mark.usefixtures("calibration_cache")
def test_kvquant_seals_a_batch_with_reads_per_layer_not_per_row():
    """KVQuant's stores asked the device, per row and layer, whether appended, aged, sink and body slots hold
    tokens (two reads per segment extended, two per compaction), and placed positions through a boolean index:
    about 12 waits per row and layer at the prefill's end, and as many when the rows caught up at the end. New
    slots that all hold tokens need no read, and the sinks' and body's counts per head come in one read for the
    layer. What is left per row is the RoPE table's size when a row's keys are read back (one read). Twice the
    rows: at most one more wait per added row and layer, in the prefill and at the end. Here 3 and 6 rows waited
    82 and 160 times in the prefill before, 47 and 89 at the end; now 12 and 18, and 7 and 7."""
    model = tiny_llama()
    layers = model.config.num_hidden_layers
    three, six = (_phases(model, "kvquant(bits=4,residual=16)", sizes) for sizes in ([(150, 4), (131, 6), (140, 3)],
                                                                                   [(150, 4), (131, 6), (140, 3)] * 2))
    for phase in (0, 5):
        assert six[phase]["waits"] - three[phase]["waits"] <= 3 * layers, (phase, three[phase], six[phase])


def test_scoring_every_prefill_query_reads_the_device_once_per_layer_whatever_the_length():
    """H2O scores every prefill query, a block of queries at a time over only the slots the block sees: the
    blocks' widths come from one read per layer, not one per block (on a GPU each read waits for the blocks
    before it). The code before read twice per block of 64: 6 more waits per layer at 200 tokens than at 80."""
    model = tiny_llama()
    waits = [_phases(model, "h2o(ratio=0.5)", [(length, 4), (length - 9, 4)], "auto")[0]["waits"]
             for length in (80, 200)]
    assert waits[0] == waits[1], waits


@pytest.mark.parametrize("spec, quantized_decode", [("none", "auto"), ("snapkv(ratio=0.5)", "auto"),
                                                    ("h2o(ratio=0.75,decode_budget=60)", "auto"),
                                                    ("kivi(bits=2,group=4,residual=4)", "codes")])
def test_the_prefill_gives_back_the_buffer_room_its_compression_freed(spec, quantized_decode):
    """Compressing at the prefill's end leaves every row far smaller than the batch buffer that held the prefill's
    K/V: a buffer that fits the rows replaces it there and then, and a quantized layer held as codes frees its
    dequantized K/V. Both waited for the next forward (the question's), and until then every layer held the
    prefill's K/V beside the rows' compressed copy or codes of them (on CUDA, the decode's peak of SnapKV and H2O at
    2,048 tokens, batch 8, on Llama-3.2-1B's shape held 470 MB more than `none`'s, KIVI's 1.0 GB). `none` keeps its
    buffer. The question's forward then runs on the buffer for the batch at once, as it did."""
    from kveval.cache.compressed import CompressedCache
    from kveval.runner.generation import prefill_prompts

    model = tiny_llama()
    prompts = random_prompts([(150, 4), (131, 6)], seed=5)
    cache = CompressedCache(model, parse_policy(spec), quantized_decode=quantized_decode)
    with torch.no_grad():
        prefill_prompts(model, cache, prompts, "context", 0)
    layers = cache.attention_layers
    capacities = [layer._buffer.capacity for layer in layers]
    longest = [max(row.store.length for row in layer.rows) for layer in layers]
    if spec == "none" or quantized_decode == "codes":  # every token kept
        assert capacities == [150 + 64] * len(layers)
    else:
        assert all(n <= 80 for n in longest), longest
        assert capacities == [n + 64 for n in longest]  # what the rows hold and the room to grow: 139 slots at most
    assert [layer._buffer.keys is None for layer in layers] == [quantized_decode == "codes"] * len(layers)
