"""Decode budgets kept once per forward, for its layers stacked (kveval.cache.decode_evictions.DeferredEvictions), keep
exactly what each layer keeps alone.

Two levels: hand-built layer buffers (ties, a NaN, a layer with another budget, a layer with a short row, chunks
smaller than the forward) compared with each layer's own eviction tensor by tensor; and whole generations (EOS
ending rows at different steps) compared with generations in which no eviction waits, fingerprint by fingerprint.
"""

import pytest
import torch

from kveval.cache import decode_evictions
from kveval.cache.decode_evictions import BudgetEviction, DeferredEvictions, HeadBudgetEviction
from kveval.cache.layers import CompressedLayer
from kveval.policies.spec import parse_policy
from kveval.runner.generation import generate
from kveval.tensors.batch_buffer import BatchBuffer

from cache_runs import fingerprint, random_prompts
from tiny_models import Tok, tiny_gemma3, tiny_llama

BATCH, HEADS, DIM = 3, 2, 4


def _buffer(seed: int, lengths: list[int], width: int, attention: bool = True) -> BatchBuffer:
    """A layer's buffer holding ``lengths`` slots per row (padding after), random K/V, shuffled positions, and
    attention with ties (values on a coarse grid) in every row."""
    g = torch.Generator().manual_seed(seed)
    buffer = BatchBuffer(BATCH, HEADS, DIM, DIM, torch.float32, "cpu")
    buffer.reserve(width + 3)
    buffer.keys[:, :, :width] = torch.randn(BATCH, HEADS, width, DIM, generator=g)
    buffer.values[:, :, :width] = torch.randn(BATCH, HEADS, width, DIM, generator=g)
    for b, n in enumerate(lengths):
        buffer.positions[b, :, :n] = torch.randperm(3 * width, generator=g)[:n].sort().values
    if attention:
        buffer.attention = torch.zeros(buffer.positions.shape)
        buffer.attention[:, :, :width] = torch.randint(0, 4, (BATCH, HEADS, width), generator=g).float() / 4
        for b, n in enumerate(lengths):
            buffer.attention[b, :, n:] = 0
    buffer.lengths, buffer.width = list(lengths), max(lengths)
    return buffer


def _state(buffer: BatchBuffer) -> tuple:
    width = buffer.width
    held = (buffer.keys, buffer.values, buffer.positions) + (() if buffer.attention is None else (buffer.attention,))
    return tuple(t[:, :, :width].clone() for t in held) + (list(buffer.lengths), width, buffer.capacity)


def _eviction(spec: str) -> BudgetEviction:
    selection = parse_policy(spec).selection
    return BudgetEviction(selection.decode_budget, selection.scores, stacks=selection.scores_stack_layers)


def _count_stacked(monkeypatch, widths: list | None = None) -> list[int]:
    """The number of layers of each stacked eviction that runs from now on (one budget for every head, or AdaKV's
    shared by the heads); ``widths``, if given, gets the set of the stacked layers' widths of each."""
    calls = []
    for name in ("_apply_stacked", "_apply_stacked_heads"):
        def counted(chunk, original=getattr(decode_evictions, name)):
            calls.append(len(chunk))
            if widths is not None:
                widths.append({buffer.width for _, buffer in chunk})
            return original(chunk)
        monkeypatch.setattr(decode_evictions, name, counted)
    return calls


@pytest.mark.parametrize("spec, other", [
    ("h2o(ratio=0.5,decode_budget=8,recent=2)", "h2o(ratio=0.5,decode_budget=7,recent=2)"),
    ("tova(ratio=0.5,decode_budget=8)", "tova(ratio=0.5,decode_budget=7)"),
    ("window(size=8)", "window(size=7)"), ("streaming(sink=2,window=6)", "streaming(sink=2,window=5)")])
@pytest.mark.parametrize("chunk_layers", [None, 2])
def test_stacked_layers_keep_what_each_keeps_alone(spec, other, chunk_layers, monkeypatch):
    """Layers evicted stacked end bit for bit as each layer's own :meth:`BudgetEviction.apply` leaves it: K, V,
    positions, attention, lengths, width and room, through ties and a NaN at the lowest score (ranked, not one
    ``min``) and a finished row (under the budget). Layers that cannot stack (another budget or width) are kept
    alone, a layer within its budget does not wait, and
    ``chunk_layers`` caps the layers stacked at once (:data:`~kveval.cache.decode_evictions.STACKED_SLOTS`)."""
    eviction, smaller = _eviction(spec), _eviction(other)
    width = eviction.budget + 1
    if chunk_layers is not None:
        monkeypatch.setattr(decode_evictions, "STACKED_SLOTS", chunk_layers * BATCH * HEADS * width)
    stacked = _count_stacked(monkeypatch)
    scored_by_attention = parse_policy(spec).selection.attention != "none"
    made = [_buffer(seed, [width] * BATCH, width, scored_by_attention) for seed in range(5)]
    if scored_by_attention:
        made[2].attention[0, 1, :width] = 0.25  # every slot of a head ties
        made[3].attention[2, 0, width // 2] = float("nan")
    layers = [(eviction, b) for b in made] + [
        (eviction, _buffer(60, [width, width - 3, width], width, scored_by_attention)),  # a finished row: stacks
        (smaller, _buffer(50, [width - 1] * BATCH, width - 1, scored_by_attention)),  # another budget: alone
        (eviction, _buffer(70, [width + 1, width, width - 2], width + 1, scored_by_attention)),  # wider: alone, ranked
        (eviction, _buffer(80, [width - 1] * BATCH, width - 1, scored_by_attention))]  # within the budget: no wait
    alone = [(e, _copy(b)) for e, b in layers]

    deferred = DeferredEvictions()
    for e, buffer in layers:
        if e.defers(buffer):
            deferred.add(e, buffer)
        else:
            e.apply(buffer)
    assert len(deferred.pending) == 8  # the layer within its budget did not wait
    assert deferred.holds(layers[0][1]) and not deferred.holds(layers[-1][1])
    deferred.flush()
    assert deferred.pending == [] and not deferred.holds(layers[0][1])
    for e, buffer in alone:
        e.apply(buffer)
    for (_, got), (_, want) in zip(layers, alone):
        for a, b in zip(_state(got), _state(want), strict=True):
            assert torch.equal(a.nan_to_num(7.0), b.nan_to_num(7.0)) if isinstance(a, torch.Tensor) else a == b
    assert layers[0][1].width == eviction.budget and layers[0][1].lengths == [eviction.budget] * BATCH
    assert stacked == ([6] if chunk_layers is None else [2, 2, 2])  # 6 layers of one budget and width; chunks of 2


def _copy(buffer: BatchBuffer) -> BatchBuffer:
    copy = BatchBuffer(BATCH, HEADS, DIM, DIM, torch.float32, "cpu")
    copy.keys, copy.values, copy.positions = buffer.keys.clone(), buffer.values.clone(), buffer.positions.clone()
    copy.attention = None if buffer.attention is None else buffer.attention.clone()
    copy.lengths, copy.width = list(buffer.lengths), buffer.width
    return copy


def test_only_budgets_that_read_positions_and_attention_stack():
    """Scores that read keys, seeds or the layer (knorm, random) never wait; nor a sliding layer's window."""
    for spec in ["knorm(ratio=0.5,decode_budget=8)", "random(ratio=0.5,decode_budget=8,seed=1)"]:
        assert not _eviction(spec).defers(_buffer(0, [9] * BATCH, 9))
    assert not BudgetEviction.of_window(9).defers(_buffer(0, [9] * BATCH, 9))
    assert _eviction("h2o(ratio=0.5,decode_budget=8)").defers(_buffer(0, [9] * BATCH, 9))
    assert not _eviction("h2o(ratio=0.5,decode_budget=8)").defers(_buffer(0, [8] * BATCH, 8))  # under budget
    assert _eviction("h2o(ratio=0.5,decode_budget=8)").defers(_buffer(0, [9, 6, 4], 9))  # one row over


STEPS = 24
SPECS = ["h2o(ratio=0.5,decode_budget=30,recent=4)", "tova(ratio=0.5,decode_budget=25)", "window(size=28)",
         "streaming(sink=2,window=20)", "h2o(ratio=0.5,decode_budget=6)",  # more recent tokens than the budget: ties
         "h2o(ratio=0.5,decode_budget=30,recent=8)+quant(bits=8,group=16)",
         # AdaKV: a budget shared by each row's heads, on layers of different widths; then ties (+inf recent tokens)
         "h2o(ratio=0.5,adaptive=true,decode_budget=12,recent=4)", "h2o(ratio=0.5,adaptive=true,decode_budget=6)"]


#: Context lengths the prefill halves to 11-26 tokens: rows reach the decode budgets at different steps.
SIZES = [(41, 4), (52, 4), (23, 4), (35, 4), (27, 4)]


@pytest.fixture(scope="module")
def model():
    return tiny_llama()


@pytest.fixture(scope="module")
def sharp():
    """tiny_llama with peaked attention (queries x 8): its heads' attention mass differs, so AdaKV gives them
    different numbers of tokens and layers of different widths (near-uniform attention splits the budget evenly)."""
    sharp = tiny_llama()
    with torch.no_grad():
        for layer in sharp.model.layers:
            layer.self_attn.q_proj.weight.mul_(8)
    return sharp


def _generate(model, spec, monkeypatch, defer=True, flush_at_last_layer=True, eos=None, mode="context"):
    checks = []
    original_update = CompressedLayer.update

    def checked_update(self, *args, **kwargs):
        if self.layer_idx == 0:  # a forward begins: nothing waits from the last one
            checks.append(self.cache.evictions.pending == [])
        return original_update(self, *args, **kwargs)

    with monkeypatch.context() as patch:
        if not defer:
            patch.setattr(BudgetEviction, "defers", lambda self, buffer: False)
            patch.setattr(HeadBudgetEviction, "defers", lambda self, buffer: False)
        if not flush_at_last_layer:  # every wait is ended by the next read of a waiting layer instead
            patch.setattr(CompressedLayer, "after_attention", lambda self, q, k, p: self._score_and_compress(q, k, p))
        patch.setattr(CompressedLayer, "update", checked_update)
        model.generation_config.eos_token_id = eos
        try:
            results = generate(model, Tok(), random_prompts(SIZES, seed=5), parse_policy(spec), max_new_tokens=STEPS, batch_size=5, mode=mode)
        finally:
            model.generation_config.eos_token_id = None
    assert len(checks) >= STEPS and all(checks) == flush_at_last_layer
    return [fingerprint(r) for r in results]


def _eos_ending_some_rows(model, spec, monkeypatch) -> int:
    free = _generate(model, spec, monkeypatch, mode="query")
    return next(t for t in sorted({t for row in free for t in row[1][2:]})
                if 2 <= sum(t in row[1] for row in free) < len(free))


@pytest.mark.parametrize("spec", SPECS)
def test_generation_with_deferred_evictions_equals_evictions_layer_by_layer(model, sharp, spec, monkeypatch):
    """Tokens, log-probabilities, bytes and kept tokens of every row are those of evicting layer by layer, with and
    without an EOS that ends rows at different steps (finished rows feed padding, so their rows stop being full),
    and with the forward's last layer not flushing (a layer's next step or a read of its rows then does)."""
    model = sharp if "adaptive" in spec else model
    widths = []
    stacked = _count_stacked(monkeypatch, widths)
    eos = _eos_ending_some_rows(model, spec, monkeypatch)
    for kwargs in ({}, {"eos": eos, "mode": "query"}):
        stacked.clear()
        deferred = _generate(model, spec, monkeypatch, **kwargs)
        assert len(stacked) > 0 and set(stacked) == {model.config.num_hidden_layers}
        assert deferred == _generate(model, spec, monkeypatch, defer=False, **kwargs)
        assert deferred == _generate(model, spec, monkeypatch, flush_at_last_layer=False, **kwargs)
    if "recent=4" in spec and "adaptive" in spec:  # heads keep different numbers of tokens: layers of two widths
        assert any(len(w) > 1 for w in widths)
    assert len({len(r[1]) for r in deferred}) >= 2  # with the EOS, rows stopped at different steps


def test_hybrid_layers_stack_the_global_layers_budgets(monkeypatch):
    """Gemma 3 with its last attention layer a sliding one (whose window is kept layer by layer, never deferred):
    the two global layers' budgets wait for it and are stacked, with the bits of evicting layer by layer, with and
    without an EOS."""
    gemma = tiny_gemma3(sliding_window=24, layer_types=["full_attention", "sliding_attention"] * 2)
    spec = "h2o(ratio=0.5,decode_budget=30,recent=4)"
    stacked = _count_stacked(monkeypatch)
    eos = _eos_ending_some_rows(gemma, spec, monkeypatch)
    for kwargs in ({}, {"eos": eos, "mode": "query"}):
        stacked.clear()
        deferred = _generate(gemma, spec, monkeypatch, **kwargs)
        assert len(stacked) > 0 and set(stacked) == {2}  # the global layers, stacked
        assert deferred == _generate(gemma, spec, monkeypatch, defer=False, **kwargs)
        assert deferred == _generate(gemma, spec, monkeypatch, flush_at_last_layer=False, **kwargs)


@pytest.mark.parametrize("spec", ["h2o(ratio=0.5,decode_budget=8,recent=2)", "window(size=8)", "random(ratio=0.5,decode_budget=8)"])
def test_a_row_given_nothing_above_the_budget_makes_no_step_evict(spec):
    """Row 0 ended (the step gave it nothing) holding 11 slots, over the budget of 8; the others hold the budget.
    Nothing drops: the step leaves the buffer as it is and says so, and defers nothing (it scored, ranked and
    gathered every row from slot 0 at every step of the batch's decode)."""
    buffer = _buffer(5, [11, 8, 8], 11)
    buffer.given = (0, 1, 1)
    before = _state(buffer)
    eviction = _eviction(spec)
    assert not eviction.defers(buffer)
    assert eviction.apply(buffer) is False
    after = _state(buffer)
    assert all(torch.equal(a, b) for a, b in zip(before[:4], after[:4])) and before[4:] == after[4:]
    # Once a row given a token is over the budget, the step evicts from it and leaves row 0 whole.
    buffer.lengths, buffer.given = [11, 9, 8], (0, 1, 0)
    buffer.positions[1, :, 8] = 1000
    assert eviction.apply(buffer) is True
    assert buffer.lengths == [11, 8, 8] and torch.equal(buffer.positions[0, :, :11], before[2][0])
