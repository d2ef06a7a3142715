"""Whether the needle's own tokens stayed in the cache: measured per item (``needle_kept``) and said in the report."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_run_folders import CharTok, _items

from kveval.policies.spec import parse_policy
from kveval.probes.item import Needle
from kveval.report.items import kept_note
from kveval.runner.evaluate import evaluate_policies
from kveval.runner.generation import Prompt, generate
from kveval.runs.records import iter_items

from cache_runs import specs_of
from tiny_models import Tok, tiny_gemma3, tiny_llama


def _prompt(watched):
    g = torch.Generator().manual_seed(3)
    return Prompt(torch.randint(1, 128, (40,), generator=g).tolist(), torch.randint(1, 128, (4,), generator=g).tolist(),
                  watched=watched)


@pytest.mark.parametrize("spec, watched, share", [
    ("none", ((0, 5),), 1.0),
    # context mode: window(ratio=0.5) keeps the last 20 of the 40 context tokens (positions 20-39), then the question
    ("window(ratio=0.5)", ((0, 5),), 0.0),
    ("window(ratio=0.5)", ((30, 35),), 1.0),
    ("window(ratio=0.5)", ((18, 22),), 0.5),
    ("window(ratio=0.5)", ((0, 2), (38, 40)), 0.5),
    ("window(ratio=0.5)", ((40, 44),), 1.0),  # the question itself is never compressed in context mode
    ("window(ratio=0.5)+quant(bits=4,group=8)", ((18, 22),), 0.5),
])
def test_needle_kept_is_the_share_of_its_token_slots_held(spec, watched, share):
    result, = generate(tiny_llama(), Tok(), [_prompt(watched)], parse_policy(spec), max_new_tokens=3)
    assert result.watched_kept == share


def test_sliding_layers_count_as_not_holding_a_needle_their_window_passed():
    # tiny Gemma 3: three sliding layers (window 16) and one full layer, one KV head: under `none` only the full layer
    # still holds tokens 0-4 of a 44-token prompt, the sliding ones hold the last 15.
    result, = generate(tiny_gemma3(), Tok(), [_prompt(((0, 5),))], parse_policy("none"), max_new_tokens=3)
    assert result.watched_kept == 0.25
    late, = generate(tiny_gemma3(), Tok(), [_prompt(((38, 42),))], parse_policy("none"), max_new_tokens=3)
    assert late.watched_kept == 1.0


def test_nothing_watched_reports_none_and_batches_agree():
    prompts = [_prompt(()), _prompt(((18, 22),))]
    one = generate(tiny_llama(), Tok(), prompts, parse_policy("snapkv(ratio=0.5,window=4)"), max_new_tokens=3, batch_size=1)
    two = generate(tiny_llama(), Tok(), prompts, parse_policy("snapkv(ratio=0.5,window=4)"), max_new_tokens=3, batch_size=2)
    assert one[0].watched_kept is None
    assert 0.0 <= one[1].watched_kept <= 1.0
    assert [r.watched_kept for r in two] == [r.watched_kept for r in one]


def test_evaluate_records_needle_kept_and_the_report_says_it(tmp_path):
    context = "the pass key is 42. " * 3  # CharTok: one token per character, 60 context tokens
    items = [replace(item, needles=[Needle("pass key", "42", "target", span)])
             for item, span in zip(_items(context), [(0, 20), (20, 40)])]
    base_dir, cand_dir = evaluate_policies(tiny_llama(), CharTok(), items, specs_of(["none", "window(ratio=0.5)"]),
                                           tmp_path, "org/M")
    base = {r.id: r for r in iter_items(base_dir)}
    cand = {r.id: r for r in iter_items(cand_dir)}
    assert [base[i].metrics["needle_kept"] for i in ("passkey-0", "passkey-1")] == [1.0, 1.0]
    # window(ratio=0.5): the last 30 of the 60 context tokens (30-59) stay: half the needle at 20-39, none of 0-19
    assert cand["passkey-0"].metrics["needle_kept"] == 0.0
    assert cand["passkey-1"].metrics["needle_kept"] == 0.5
    assert kept_note(cand["passkey-0"], items[0], base["passkey-0"]) == \
        "The needle (tokens 0-20 of the prompt) was dropped from every layer and head."
    assert kept_note(cand["passkey-1"], items[1], base["passkey-1"]) == \
        "The cache kept 50% of the needle's token slots (tokens 20-40 of the prompt), over layers and heads."
    assert kept_note(base["passkey-0"], items[0]) == ""  # the baseline kept everything: nothing to say


def test_runs_before_needle_kept_say_it_is_not_recorded(tmp_path):
    _, cand_dir = evaluate_policies(tiny_llama(), CharTok(), _items(), specs_of(["none", "window(size=8)"]), tmp_path, "org/M")
    record = next(iter_items(cand_dir))
    assert record.metrics["needle_kept"] is None  # the item has no needle
    assert "not recorded" in kept_note(record, None)
