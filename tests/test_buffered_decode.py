"""Decode steps done on the layer's batch buffer alone (kveval.cache.buffered_decode) change nothing but speed.

Each policy is generated twice on the same batch of mixed-length prompts (left
padding, an EOS that ends rows early, so finished rows feed padding): once with
the batched decode, once with it switched off, so that every decode step goes
through the rows' own stores one by one as before. Tokens, log-probabilities
and every byte and kept token must be equal, bit for bit, and the batched path
must really have run. Decoding runs past ``CATCH_UP_STEPS`` so the rows catch up
mid-generation, and far enough for KIVI's per-channel key groups to age out of
a short residual window at different steps in different rows.
"""

import pytest
import torch

from kveval.cache import buffered_decode, coded_rows
from kveval.cache.buffered_decode import BufferedDecode
from kveval.cache.compressed import CompressedCache
from kveval.cache.decode_evictions import _ranked_kept, kept_slots
from kveval.cache.layers import CompressedLayer
from kveval.policies.spec import parse_policy
from kveval.runner.generation import Prompt, generate
from kveval.dtypes import parse_kv_dtype
from kveval.tensors import batch_buffer
from kveval.tensors.batch_buffer import BatchBuffer
from kveval.tensors.ranking import top_slots

from cache_runs import fingerprint
from tiny_models import Tok, tiny_gemma3, tiny_llama, tiny_model

#: Catch-ups, buffer growth and code growth come every 16 steps or slots here (64 in use): the same code, reached
#: in 30 decode steps instead of 70 (:func:`dense_events`).
CATCH_UP_STEPS, MIN_GROWTH = 16, 16
STEPS = 30


@pytest.fixture(autouse=True)
def dense_events(monkeypatch):
    monkeypatch.setattr(buffered_decode, "CATCH_UP_STEPS", CATCH_UP_STEPS)
    monkeypatch.setattr(batch_buffer, "_MIN_GROWTH", MIN_GROWTH)
    monkeypatch.setattr(coded_rows, "_MIN_GROWTH_TOKENS", MIN_GROWTH)
SPECS = ["none", "quant(bits=8,group=16)", "quant(bits=4,group=8,residual=5)", "quant(bits=2,group=8,symmetric=true)",
         "kivi(bits=2,group=8,residual=12)",
         "fp8(group=16,residual=3)", "snapkv(ratio=0.5)", "snapkv(ratio=0.5)+kivi(bits=4,group=8,residual=4)",
         "streaming(sink=2,window=20)", "window(size=30)", "streaming(ratio=0.5)",
         # Scored by attention at every step, with or without a decode budget (the buffer accumulates the scores)
         "h2o(ratio=0.5,decode_budget=40,recent=8)", "tova(ratio=0.5,decode_budget=30)",
         "h2o(ratio=0.5,decode_budget=6)",  # more recent tokens (scored +inf) than the budget: ties decide
         "h2o(ratio=0.5)+kivi(bits=4,group=8,residual=4)", "tova(ratio=0.3)", "knorm(ratio=0.5,decode_budget=25)",
         "random(ratio=0.5,decode_budget=30,seed=3)",
         # Per-head budgets chosen at the prefill (AdaKV): heads of one row hold different counts
         "snapkv(ratio=0.5,adaptive=true)", "h2o(ratio=0.6,adaptive=true)",
         # ... and kept while decoding, the heads sharing the row's budget by score (AdaKV's decode budget)
         "h2o(ratio=0.5,adaptive=true,decode_budget=30)", "knorm(ratio=0.5,adaptive=true,decode_budget=25,floor=0.5)",
         "random(ratio=0.5,adaptive=true,decode_budget=30)",
         # ... with more recent tokens (scored +inf) than the layer's budget: ties decide, as each row alone decides them
         "h2o(ratio=0.5,adaptive=true,decode_budget=6)",
         # ... over quantized heads: each head ages its own residual window (per-channel groups out of phase)
         "snapkv(ratio=0.5,adaptive=true)+quant(bits=8,group=16)", "snapkv(ratio=0.5,adaptive=true)+kivi(bits=4,group=8,residual=4)",
         "h2o(ratio=0.6,adaptive=true)+kivi(bits=2,group=8,residual=12)",
         # Decode budgets over tokens quantized alone as they arrive: evictions drop whole encoded tokens
         "h2o(ratio=0.5,decode_budget=40,recent=8)+quant(bits=8,group=16)", "streaming(sink=2,window=20)+fp8(group=16)",
         "tova(ratio=0.5,decode_budget=30)+quant(bits=4,group=8)", "knorm(ratio=0.5,decode_budget=25)+quant(bits=2,group=4)"]


def _prompts(n=5, seed=11):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(20, 70, (n,), generator=g).tolist()
    return [Prompt(torch.randint(3, 128, (k,), generator=g).tolist(), torch.randint(3, 128, (4,), generator=g).tolist())
            for k in lengths]


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


def _run(model, spec, batched: bool, monkeypatch, mode="context", eos=None, kv_dtype=None, batch_size=5, prompts=None,
         codes=False):
    calls = []
    original = BufferedDecode.append

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(BufferedDecode, "append", counted)
        if not batched:
            patch.setattr(CompressedLayer, "_batched_decode", lambda self: None)
        if codes:  # what "auto" does on CUDA: quantized layers decode from their codes
            patch.setattr(CompressedCache, "decodes_from_codes", lambda self, device: True)
        model.generation_config.eos_token_id = eos
        results = generate(model, Tok(), prompts or _prompts(), parse_policy(spec), max_new_tokens=STEPS, batch_size=batch_size, mode=mode,
                           kv_dtype=kv_dtype)
        model.generation_config.eos_token_id = None
    return [fingerprint(r) for r in results], len(calls)


def _assert_batched_equals_rows(model, spec, monkeypatch, codes=False, **kwargs):
    """Generate ``spec`` batched (from codes, with ``codes``) and row by row: bit-identical, and batched really ran."""
    batched, used = _run(model, spec, True, monkeypatch, codes=codes, **kwargs)
    rows, unused = _run(model, spec, False, monkeypatch, **kwargs)
    assert used > 0 and unused == 0
    assert batched == rows
    return batched


MASK_SPECS = ["snapkv(ratio=0.5)", "snapkv(ratio=0.5)+kivi(bits=4,group=8,residual=4)", "streaming(sink=2,window=20)",
              "h2o(ratio=0.5,decode_budget=40,recent=8)", "tova(ratio=0.5,decode_budget=30)",
              "random(ratio=0.5,decode_budget=30,seed=3)", "knorm(ratio=0.5,decode_budget=25)+quant(bits=2,group=4)",
              "h2o(ratio=0.5,adaptive=true,decode_budget=30)"]  # per-head budgets: masks from the held slots


@pytest.mark.parametrize("name, spec", [("llama", "none"), ("llama", "kivi(bits=4,group=8,residual=4)"),
                                        ("llama", "lowrank(rank=8)"), ("gemma3", "none"), ("gemma3", "snapkv(ratio=0.5)"),
                                        ("gemma3", "quant(bits=8,group=16)"), ("llama4", "none"),
                                        ("llama", "snapkv(ratio=0.5)")])  # selects per head: read, never trusted
def test_a_layer_that_selects_nothing_holds_the_same_slots_in_every_head(gemma, name, spec, monkeypatch):
    """A mask from positions skips reading whether the heads share slots where the layer selects nothing (its
    selection is None: a sliding layer always, a full one under a policy without selection): every mask built so
    holds slots equal in every head, at every forward of mixed-length batches with padding."""
    from kveval.cache import layer_masks
    from kveval.cache import layers as cache_layers

    model = gemma if name == "gemma3" else (tiny_model(name) if name == "llama4" else tiny_llama())
    trusted = []
    original = layer_masks.positions_mask

    def checked(slots, queries, window, chunked, heads_share=False):
        if heads_share:
            trusted.append(1)
            assert torch.equal(slots, slots[:, :1].expand_as(slots))
        return original(slots, queries, window, chunked, heads_share)

    monkeypatch.setattr(cache_layers, "positions_mask", checked)
    _run(model, spec, True, monkeypatch, prompts=_prompts(n=4, seed=5), batch_size=4)
    assert bool(trusted) == (name != "llama" or not spec.startswith("snapkv"))  # Gemma 3: its sliding layers


@pytest.mark.parametrize("spec", MASK_SPECS)
def test_decode_step_masks_from_lengths_are_the_masks_of_positions(model, spec, monkeypatch):
    """A decode step's mask made from the rows' lengths (``[B, 1, 1, width]``, :func:`visible_prefix`), or under
    per-head budgets from the slots that hold a token (:func:`held_slots`), is, in every
    head, the mask the slots' positions give (:meth:`CompressedLayer.allowed_mask`), at every step of every layer,
    and the generation (finished rows feeding padding) has the bits of building every mask from positions."""
    from kveval.cache import layers as cache_layers

    made_from_lengths, made_from_held = [], []
    original_step_mask, original_prefix, original_held = (CompressedLayer._step_mask, cache_layers.visible_prefix,
                                                          cache_layers.held_slots)

    def checked_step_mask(self, positions, all_real):
        mask = original_step_mask(self, positions, all_real)
        reference = self.allowed_mask(positions)
        heads = max(mask.shape[1], reference.shape[1])
        assert torch.equal(mask.expand(-1, heads, -1, -1), reference.expand(-1, heads, -1, -1))
        return mask

    def counted_prefix(*args):
        made_from_lengths.append(1)
        return original_prefix(*args)

    def counted_held(*args):
        made_from_held.append(1)
        return original_held(*args)

    for eos in (None, _eos_ending_some_rows(model, spec, monkeypatch)):
        with monkeypatch.context() as patch:
            patch.setattr(CompressedLayer, "_step_mask", checked_step_mask)
            patch.setattr(cache_layers, "visible_prefix", counted_prefix)
            patch.setattr(cache_layers, "held_slots", counted_held)
            from_lengths, _ = _run(model, spec, True, monkeypatch, eos=eos)
        with monkeypatch.context() as patch:
            patch.setattr(CompressedLayer, "_step_mask", lambda self, positions, all_real: self.allowed_mask(positions))
            from_positions, _ = _run(model, spec, True, monkeypatch, eos=eos)
        assert from_lengths == from_positions
        if eos is None:  # every row decodes every step: each layer's mask after its compression, from lengths
            assert (len(made_from_lengths) == 0) == ("adaptive" in spec)  # or, heads apart, from the held slots
            assert (len(made_from_held) == 0) == ("adaptive" not in spec)
    assert len({len(r[1]) for r in from_lengths}) >= 2  # with the EOS, rows stopped at different steps


def _eos_ending_some_rows(model, spec, monkeypatch) -> int:
    """A token that at least 2 rows, but not all, generate in query mode: as EOS it ends rows at different steps."""
    free, _ = _run(model, spec, True, monkeypatch, mode="query")
    return next(t for t in sorted({t for row in free for t in row[1][2:]})
                if 2 <= sum(t in row[1] for row in free) < len(free))


@pytest.mark.parametrize("spec", SPECS)
def test_batched_decode_equals_row_by_row_decode(model, spec, monkeypatch):
    _assert_batched_equals_rows(model, spec, monkeypatch)


@pytest.mark.parametrize("batched", [True, False])
@pytest.mark.parametrize("spec", ["h2o(ratio=0.5)", "tova(ratio=0.3)", "h2o(ratio=0.6,adaptive=true)",
                                  "h2o(ratio=0.5)+kivi(bits=4,group=8,residual=4)"])
def test_no_attention_is_scored_once_nothing_can_use_it(model, spec, batched, monkeypatch):
    """H2O and TOVA without a decode budget select once, at the prefill: no later step computes attention
    probabilities for them (their scores would rank nothing), so their decode steps cost what ``none``'s do. The
    probabilities are counted for a short and a long generation: the same calls, those of the prefill."""
    from kveval.modeling.architectures import SdpaKernel

    calls = []
    original = SdpaKernel.probabilities

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(SdpaKernel, "probabilities", counted)
    counts = []
    for steps in (2, 12):
        calls.clear()
        with monkeypatch.context() as patch:
            if not batched:
                patch.setattr(CompressedLayer, "_batched_decode", lambda self: None)
            generate(model, Tok(), _prompts(), parse_policy(spec), max_new_tokens=steps, batch_size=5)
        counts.append(len(calls))
    assert counts[0] > 0 and counts[0] == counts[1]


def _prefill_and_decode(model, spec, prompt_tokens: int, steps: int = 3) -> CompressedCache:
    """A 2-row cache of ``spec`` after a ``prompt_tokens`` prefill and ``steps`` one-token decode steps."""
    cache = CompressedCache(model, parse_policy(spec))
    ids = torch.randint(3, 128, (2, prompt_tokens), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        model(ids, cache=cache, position_ids=torch.arange(prompt_tokens).expand(2, -1))
        for step in range(steps):
            model(ids[:, :1], cache=cache, position_ids=torch.full((2, 1), prompt_tokens + step))
    return cache


@pytest.mark.parametrize("spec, scores_held", [("h2o(ratio=0.5)", False), ("tova(ratio=0.3)", False),
                                                ("h2o(ratio=0.5,decode_budget=40)", True)])
def test_scores_are_held_and_counted_only_while_a_budget_ranks_them(model, spec, scores_held):
    """Once the prefill has selected, a policy without a decode budget holds no scores: its index bytes are the
    kept tokens' positions alone (8 B each). Under a decode budget the scores stay, and are counted (4 B each)."""
    cache = _prefill_and_decode(model, spec, 60)
    stats = cache.stats()
    rows = [row for layer in cache.layers for row in layer.rows]
    positions = sum(row.positions.numel() for row in rows)
    assert all((row.attention is not None) == scores_held for row in rows)
    assert stats.index_bytes == positions * 8 + (positions * 4 if scores_held else 0)


@pytest.mark.parametrize("spec", ["none", "snapkv(ratio=0.5)", "quant(bits=4,group=8,residual=5)", "streaming(sink=2,window=20)"])
def test_cache_in_the_compute_dtype(model, spec, monkeypatch):
    """kv_dtype = compute dtype (a bf16 model on a GPU): dense rows' stores are views of the buffer, across its
    growth and the catch-ups; still equal to row-by-row decoding, and the bytes are those of the kept tokens."""
    _assert_batched_equals_rows(model, spec, monkeypatch, kv_dtype=torch.float32)


@pytest.mark.parametrize("spec", ["quant(bits=4,group=8,residual=5)", "kivi(bits=2,group=8,residual=12)", "window(size=90)"])
def test_batch_size_one(model, spec, monkeypatch):
    """One row: every step encodes the same slots of the whole batch (the view path rather than the gather).

    ``window(size=90)`` keeps every prompt token (each prompt is shorter), so the cache lines up with the input
    columns until the first decode-time eviction, which must switch the layer to its own mask."""
    _assert_batched_equals_rows(model, spec, monkeypatch, batch_size=1)


def test_finished_rows_and_query_mode(model, monkeypatch):
    """An EOS that ends some rows early (they feed padding from then on), in query mode."""
    spec = "quant(bits=4,group=8,residual=5)"
    batched = _assert_batched_equals_rows(model, spec, monkeypatch, mode="query", eos=_eos_ending_some_rows(model, spec, monkeypatch))
    assert len({len(r[1]) for r in batched}) >= 2  # rows stopped at different steps


@pytest.mark.parametrize("seed", range(5))
def test_one_drop_per_row_keeps_what_the_ranking_keeps(seed):
    """A step over budget drops each row's lowest score (one ``min``): the slots the ranking keeps (``top_slots``:
    best first, equal scores in slot order), from the first dropped slot on; a tie or a NaN at a full row's lowest
    score goes to the ranking itself."""
    g = torch.Generator().manual_seed(seed)
    budget, lengths = 8, [9, 9, 7, 8]  # two full rows, two with padding slots (-inf)
    scores = torch.rand(4, 3, budget + 1, generator=g) + 1
    scores[:, :, :5] += 1  # every row's lowest score is at slot 5 or later
    for b, n in enumerate(lengths):
        scores[b, :, n:] = float("-inf")
        scores[b, :, n - 1] = float("inf")  # the newest slot
    keep, first = kept_slots(scores, budget, lengths)
    reference = top_slots(scores, budget, dim=2)
    assert first >= 5 and torch.equal(keep[:, :, :first], torch.arange(first).expand(4, 3, -1))
    assert torch.equal(keep[:2], reference[:2])  # full rows: the same slots
    for b, n in enumerate(lengths[2:], start=2):  # padded rows drop a padding slot: every real slot stays in place
        assert torch.equal(keep[b, :, :n], torch.arange(n).expand(3, -1))
    for planted in (scores[1, 2].min(), float("nan")):  # a tie at a full row's lowest score, then a NaN
        unclear = scores.clone()
        unclear[1, 2, 0] = planted
        keep, first = kept_slots(unclear, budget, lengths)
        assert first == 0 and torch.equal(keep, top_slots(unclear, budget, dim=2))
    tied_padding = scores.clone()
    tied_padding[2, 0, 0] = tied_padding[2, 0, 1] = 1.5  # a tie in a padded row does not matter: it drops padding
    assert kept_slots(tied_padding, budget, lengths)[1] >= 5
    wider = torch.cat([scores, scores[:, :, -1:]], dim=2)  # two over budget: the ranking
    assert torch.equal(kept_slots(wider, budget, [n + 1 for n in lengths])[0], top_slots(wider, budget, dim=2))
    # Without reading the device (scores per layer): the ranking's slots, ties and NaN included, padded rows too
    tie, nan = scores.clone(), scores.clone()
    tie[1, 2, 0], nan[1, 2, 0] = scores[1, 2].min(), float("nan")
    for case in (scores, tied_padding, wider, tie, nan):
        assert torch.equal(_ranked_kept(case, budget), top_slots(case, budget, dim=2))


@pytest.mark.parametrize("with_values, with_attention", [(True, True), (True, False), (False, True)])
def test_one_token_per_row_of_different_lengths_goes_to_each_rows_next_slot(with_values, with_attention):
    """A decode step over rows of different lengths (mixed prompt lengths, per-head budgets) writes each row's token
    by one flat index per tensor: the same tensors as writing row by row, a bfloat16 token converted to the
    buffer's float32, room grown where the longest row needed it, nothing else touched."""
    g = torch.Generator().manual_seed(0)
    lengths, heads, dim = [5, 9, 2, 9], 3, 4
    buffer = BatchBuffer(len(lengths), heads, dim, dim, torch.float32, "cpu")
    buffer.reserve(9)
    capacity = buffer.capacity
    for b, n in enumerate(lengths):
        buffer.write_row(b, 0, torch.randn(heads, n, dim, generator=g), torch.randn(heads, n, dim, generator=g),
                         torch.arange(n).expand(heads, -1) + 10 * b)
    if with_attention:
        buffer.attention = torch.rand(buffer.positions.shape, generator=g)
    for step in range(capacity - 9 + 1):  # the last step outgrows the room
        expected = [None if t is None else t.clone() for t in (buffer.keys, buffer.values, buffer.positions, buffer.attention)]
        if not with_values:
            buffer.release_values()
        keys, values = (torch.randn(len(lengths), heads, 1, dim, generator=g).to(torch.bfloat16) for _ in range(2))
        positions = torch.tensor([[100 + step + 10 * b] for b in range(len(lengths))])
        starts = list(buffer.lengths)
        buffer.append(keys if with_values else None, values if with_values else None, positions,
                      torch.ones(len(lengths), 1, dtype=torch.bool), [1] * len(lengths))
        if buffer.capacity > capacity:  # grown: the old room is the reference's too
            expected = [None if t is None else torch.cat([t, t.new_zeros(*t.shape[:2], buffer.capacity - capacity,
                                                                         *t.shape[3:])], dim=2) for t in expected]
            expected[2][:, :, capacity:] = batch_buffer.PAD_POSITION
        for b, n in enumerate(starts):
            if with_values:
                expected[0][b, :, n], expected[1][b, :, n] = keys[b, :, 0].float(), values[b, :, 0].float()
            expected[2][b, :, n] = positions[b, 0]
            if with_attention:
                expected[3][b, :, n] = 0
        for got, want in zip((buffer.keys, buffer.values, buffer.positions, buffer.attention), expected):
            assert (got is None and (want is None or not with_values)) or torch.equal(got, want)
        assert buffer.lengths == [n + 1 for n in starts] and buffer.width == max(starts) + 1
    assert buffer.capacity > capacity


def test_no_step_copies_the_cache(model):
    """Decode steps write into the buffer in place: its tensors are reallocated only when capacity runs out."""
    cache = CompressedCache(model, parse_policy("none"))
    ids = torch.randint(3, 128, (3, 40), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(ids, cache=cache, position_ids=torch.arange(40).expand(3, -1))
        layer = cache.layers[0]
        buffer: BatchBuffer = layer._buffer
        pointers = {buffer.keys.data_ptr()}
        for step in range(buffer.capacity - 40 + 1):
            model(ids[:, :1], cache=cache, position_ids=torch.full((3, 1), 40 + step))
            pointers.add(layer._buffer.keys.data_ptr())
    assert layer._buffer is buffer
    assert len(pointers) == 2  # one growth, once the first capacity was used up
    assert buffer.width == 40 + step + 1
    assert cache.stats().kept_tokens[0] == [40 + step + 1] * 3


@pytest.fixture(scope="module")
def gemma():
    return tiny_gemma3(sliding_window=24)


@pytest.mark.usefixtures("calibration_cache")
@pytest.mark.parametrize("spec", ["none", "snapkv(ratio=0.5)", "h2o(ratio=0.5,decode_budget=40)", "kivi(bits=4,group=8,residual=4)",
                                  "quant(bits=8,group=16)", "fp8(group=16,residual=3)", "kvquant(bits=4)",
                                  "kvquant(bits=3,residual=5,sink=30)", "snapkv(ratio=0.5)+kivi(bits=2,group=8,residual=16)",
                                  # residual + group past the window: trims would reach unencoded tokens (row by row)
                                  "kivi(bits=2,group=8,residual=20)"])
def test_sliding_window_layers(gemma, spec, monkeypatch):
    """Gemma 3's local layers (a window of 24 positions here) drop what their next query cannot see, for the batch
    at once: prompts longer and shorter than the window, so some rows start trimming only while decoding. Quantized
    rows too: a trim drops the oldest tokens, long encoded, and the rows replay the steps when they catch up."""
    prompts = _prompts(n=4, seed=5)
    prompts[0] = Prompt(prompts[0].context[:10], prompts[0].question)
    _assert_batched_equals_rows(gemma, spec, monkeypatch, prompts=prompts, batch_size=4)


@pytest.mark.parametrize("spec", ["none", "quant(bits=8,group=16)", "kivi(bits=4,group=8,residual=4)",
                                  "snapkv(ratio=0.5)", "h2o(ratio=0.5,decode_budget=40)"])
def test_chunked_layers_decode_in_batch_from_the_positions_the_driver_declares(spec, monkeypatch):
    """Llama 4's attention passes no ``position_ids`` to the cache, so its layers decoded row by row, counting each
    row's tokens; the driver declares the positions it gives the model (``set_input_mask(..., positions=)``), and
    its chunked layers (chunks of 16 here) and full layers decode on the batch buffer, with the bits of row by row
    from counted positions; rows finishing early too."""
    model = tiny_model("llama4")
    prompts = _prompts(n=4, seed=5)
    prompts[0] = Prompt(prompts[0].context[:10], prompts[0].question)
    batched_layers = set()
    original = CompressedLayer._can_decode_on_buffer

    def noted(self, kwargs, q_len):
        can = original(self, kwargs, q_len)
        if can:
            batched_layers.add(self.chunked)
        return can

    for eos in (None, _eos_ending_some_rows(model, spec, monkeypatch)):
        with monkeypatch.context() as patch:
            patch.setattr(CompressedLayer, "_can_decode_on_buffer", noted)
            batched, used = _run(model, spec, True, monkeypatch, eos=eos, prompts=prompts, batch_size=4)
        with monkeypatch.context() as patch:  # the reference: row by row, positions counted per row as before
            patch.setattr(CompressedLayer, "_given_positions", lambda self, kwargs, q_len: (kwargs or {}).get("position_ids"))
            rows, unused = _run(model, spec, False, monkeypatch, eos=eos, prompts=prompts, batch_size=4)
        assert used > 0 and unused == 0 and batched == rows
    assert batched_layers == {True, False}  # the chunked layer and the full one


@pytest.mark.parametrize("name, spec", [("gemma3", "none"), ("gemma3", "quant(bits=8,group=16)"),
                                        ("gemma3", "kivi(bits=4,group=8,residual=4)"), ("llama4", "none")])
def test_sliding_layers_step_masks_from_lengths_are_the_masks_of_positions(gemma, name, spec, monkeypatch):
    """A sliding layer decoding on its buffer with the window's eviction holds no more than its query sees, so its
    decode step's mask comes from the rows' lengths (no device read of whether heads share slots) and equals, at
    every step, the mask of the slots' positions and window; rows shorter and longer than the window, rows that
    finish early. Not so a chunked layer (Llama 4, chunks of 16), whose query sees its own chunk only. The
    generation has the bits of building every mask from positions, and the window's eviction
    (:func:`~kveval.cache.decode_evictions._window_kept`, known from the lengths) keeps what ranking by position keeps."""
    from kveval.cache import decode_evictions

    model = gemma if name == "gemma3" else tiny_model(name)

    sliding_from_lengths = []
    original_step_mask = CompressedLayer._step_mask

    def checked_step_mask(self, positions, all_real):
        mask = original_step_mask(self, positions, all_real)
        reference = self.allowed_mask(positions)
        heads = max(mask.shape[1], reference.shape[1])
        assert torch.equal(mask.expand(-1, heads, -1, -1), reference.expand(-1, heads, -1, -1))
        if self.is_sliding and positions.shape[1] == 1 and all_real and self._window_holds_all():
            sliding_from_lengths.append(1)
        return mask

    def ranked_window(self, buffer):  # the eviction as before: scored by position, ranked, a min per row
        if buffer.width <= self.budget:
            return False
        scores, _ = decode_evictions.scored_slots(buffer, lambda state: state.positions.float(), self.context,
                                                  tokens_first=True)
        keep, first = kept_slots(scores, self.budget, buffer.lengths)
        decode_evictions._compact(buffer, keep[:, :, first:], first, self.budget)
        return True

    prompts = _prompts(n=4, seed=5)
    prompts[0] = Prompt(prompts[0].context[:10], prompts[0].question)
    for eos in (None, _eos_ending_some_rows(model, spec, monkeypatch)):
        with monkeypatch.context() as patch:
            patch.setattr(CompressedLayer, "_step_mask", checked_step_mask)
            from_lengths, used = _run(model, spec, True, monkeypatch, eos=eos, prompts=prompts, batch_size=4)
        with monkeypatch.context() as patch:
            patch.setattr(CompressedLayer, "_step_mask", lambda self, positions, all_real: self.allowed_mask(positions))
            patch.setattr(decode_evictions.BudgetEviction, "apply", ranked_window)
            from_positions, _ = _run(model, spec, True, monkeypatch, eos=eos, prompts=prompts, batch_size=4)
        assert used and from_lengths == from_positions
    if name == "gemma3":
        assert len(sliding_from_lengths) > STEPS  # several sliding layers, most steps
    else:
        assert not sliding_from_lengths


@pytest.mark.usefixtures("calibration_cache")
@pytest.mark.parametrize("spec", ["none", "quant(bits=8,group=16)", "kivi(bits=4,group=8,residual=8)", "kvquant(bits=4)"])
def test_sliding_layers_decode_in_batch(gemma, spec):
    """The sliding layers really take the batched path, dense or quantized (the residual and a unit fit the window)."""
    cache = _prefill_and_decode(gemma, spec, 40)
    sliding = [layer for layer in cache.layers if layer.is_sliding]
    assert sliding and all(layer._decode is not None and layer._decode.eviction is not None for layer in sliding)
    assert all(layer._buffer.width == 23 for layer in sliding)  # window - 1 tokens between forwards
    assert cache.stats().kept_tokens[0] == [23, 23]


CODED_SPECS = ["quant(bits=8,group=16)", "quant(bits=4,group=8,residual=5)", "kivi(bits=2,group=8,residual=12)",
               "fp8(group=16,residual=3)", "quant(bits=2,group=8,symmetric=true)",
               "snapkv(ratio=0.5)+kivi(bits=4,group=8,residual=4)", "h2o(ratio=0.5)+quant(bits=4,group=8)"]


@pytest.mark.parametrize("spec", CODED_SPECS)
def test_decoding_from_codes_equals_row_by_row_decode(model, spec, monkeypatch):
    """Quantized layers held as codes and dequantized at every step (CUDA's default) answer as row by row."""
    _assert_batched_equals_rows(model, spec, monkeypatch, codes=True)


def test_decoding_from_codes_finished_rows_at_batch_one(model, monkeypatch):
    """Codes with an EOS ending rows early (index writes) and with one row (slice writes)."""
    spec = "kivi(bits=4,group=8,residual=4)"
    for kwargs in ({"mode": "query", "eos": _eos_ending_some_rows(model, spec, monkeypatch)}, {"batch_size": 1}):
        _assert_batched_equals_rows(model, spec, monkeypatch, codes=True, **kwargs)


def test_codes_hold_the_cache_once(model):
    """Held as codes, no layer keeps a dequantized copy: the layers' buffers hold positions only, the rows' codes
    and full-precision residuals are views of the batch's, and the one shared scratch is the size of one layer's K/V."""
    cache = CompressedCache(model, parse_policy("quant(bits=4,group=8,residual=4)"), quantized_decode="codes", kv_dtype=parse_kv_dtype("bfloat16"))
    batch, length = 3, 40
    ids = torch.randint(3, 128, (batch, length), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        model(ids, cache=cache, position_ids=torch.arange(length).expand(batch, -1))
        for step in range(20):
            model(ids[:, :1], cache=cache, position_ids=torch.full((batch, 1), length + step))
    layers = cache.attention_layers
    assert all(layer._decode is not None and layer._decode.coded is not None for layer in layers)
    assert all(layer._buffer.keys is None and layer._buffer.values is None for layer in layers)
    one_layer = 2 * batch * model.config.num_key_value_heads * (length + 20) * cache.head_dim * 4  # K+V, float32
    assert one_layer <= cache.scratch.nbytes <= 2 * one_layer  # grown by at most an eighth or 64 slots
    coded = layers[0]._decode.coded[0]
    row = layers[0].rows[1].store.k
    assert row.block.data.untyped_storage().data_ptr() == coded.block.data.untyped_storage().data_ptr()
    assert row.tail.untyped_storage().data_ptr() == coded.tail.untyped_storage().data_ptr()  # the residual too
    stats = cache.stats()
    assert stats.kept_tokens[0] == [length + 20] * batch
    assert sum(side.nbytes for layer in layers for side in layer._decode.coded) == stats.kv_bytes


def test_quantized_decode_mode_is_checked(model):
    with pytest.raises(ValueError, match="quantized_decode='fast' is not a mode; use one of auto, buffer, codes"):
        CompressedCache(model, parse_policy("quant(bits=8,group=16)"), quantized_decode="fast")
    cache = CompressedCache(model, parse_policy("quant(bits=8,group=16)"))
    assert cache.decodes_from_codes("cuda") and not cache.decodes_from_codes("cpu")


@pytest.mark.usefixtures("calibration_cache")
@pytest.mark.parametrize("spec", ["lowrank(rank=8)", "lowrank(k_rank=12,v_rank=4)", "lowrank(energy=0.9)",
                                  "snapkv(ratio=0.5)+lowrank(rank=8)", "h2o(ratio=0.5)+lowrank(rank=12)",
                                  # Cross-head latent: one basis for both KV heads, with or without RoPE dims kept out
                                  "latent(rank=12)", "latent(rank=10,rope_dims=4)", "latent(rank=6,group=1)",
                                  "snapkv(ratio=0.5)+latent(rank=16)",
                                  # Over quantized coefficients: those leaving the residual window change their K/V
                                  "lowrank(rank=8)+quant(bits=8,group=4)", "lowrank(energy=0.9)+kivi(bits=4,group=4,residual=4)",
                                  "latent(rank=12)+quant(bits=4,group=4,residual=3)",
                                  "latent(rank=10,rope_dims=4)+kivi(bits=2,group=2,residual=5)",
                                  "h2o(ratio=0.5)+lowrank(rank=8)+kivi(bits=4,group=8,residual=2)"])
@pytest.mark.parametrize("mode", ["context", "query"])
def test_low_rank_rows(model, spec, mode, monkeypatch):
    """Low-rank and latent rows: each step projects and reconstructs every row's new token at once (steps of
    several tokens, the query after the context, go row by row), bit for bit as each row's store would; over
    quantized coefficients, the tokens whose coefficients leave the residual window are reconstructed again."""
    _assert_batched_equals_rows(model, spec, monkeypatch, mode=mode)


@pytest.mark.usefixtures("calibration_cache")
@pytest.mark.parametrize("spec", ["kvquant(bits=4)", "kvquant(bits=3,outliers=0.1,residual=7,sink=60)",
                                  "kvquant(bits=2,pre_rope=false,nuq=false,sink=0)", "snapkv(ratio=0.5)+kvquant(bits=4,residual=3)",
                                  "h2o(ratio=0.5)+kvquant(bits=4,residual=5)"])
@pytest.mark.parametrize("mode", ["context", "query"])
def test_kvquant_rows(model, spec, mode, monkeypatch):
    """KVQuant rows: the tokens leaving the residual window are encoded for the batch at once (pre-RoPE keys
    un-rotated at their positions, sinks left as they came: ``sink=60`` is past the shorter prompts) and read back
    as each row's store reads them."""
    _assert_batched_equals_rows(model, spec, monkeypatch, mode=mode)


@pytest.mark.usefixtures("calibration_cache")
@pytest.mark.parametrize("spec", ["duo(heads=0.5,sink=2,window=20)", "duo(heads=0.5,sink=2,ratio=0.5)",
                                  "duo(heads=0,sink=2,window=20)"])
def test_duo_head_budgets(model, spec, monkeypatch):
    """DuoAttention-style budgets, fixed per head while decoding (retrieval heads keep every token, streaming heads
    sink + window): the heads of a row hold different counts, evicted for the batch at once."""
    _assert_batched_equals_rows(model, spec, monkeypatch)


@pytest.mark.parametrize("spec, kept", [("snapkv(ratio=0.75)", 56), ("h2o(ratio=0.5,decode_budget=60)", 60), ("none", 206)])
def test_compression_frees_the_buffer_room(model, spec, kept):
    """Once the rows hold far fewer tokens than the prefill (selection, a decode budget), the buffer attention reads
    is rebuilt to fit them: its room is not the prefill's for the rest of the decode."""
    cache = CompressedCache(model, parse_policy(spec))
    ids = torch.randint(3, 128, (2, 200), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        model(ids, cache=cache, position_ids=torch.arange(200).expand(2, -1))
        for step in range(6):
            model(ids[:, :1], cache=cache, position_ids=torch.full((2, 1), 200 + step))
    for layer in cache.attention_layers:
        assert layer._buffer.width == kept
        assert layer._buffer.capacity <= 2 * max(64, kept)
