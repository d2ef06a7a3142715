"""A batch's composition changes no item's record: items whose answers may run to different lengths (families
with different ``max_new_tokens``) decode in one batch exactly as each does alone.

The tiny model has no EOS, so every row runs to its own limit: a row given the batch's longest limit instead
would answer with more tokens, hold more of them in its cache (bytes) and could turn right or wrong.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_run_folders import CharTok, _items
from test_shared_prefill import _records

from kveval.errors import UsageError
from kveval.policies.spec import parse_policy
from kveval.runner.evaluate import evaluate_policies
from kveval.runner.generation import Prompt, generate, generate_many
from kveval.runs.fidelity import read_fidelity

from cache_runs import specs_of
from tiny_models import tiny_llama

LIMITS = [2, 7, 3, 5, 1]


def _mixed_items():
    items = _items("the pass key is 42. " * 3, n=3) + _items("a note: the key is 7. then filler text follows. " * 2, n=2)
    return [replace(item, id=f"item-{i}", max_new_tokens=limit) for i, (item, limit) in enumerate(zip(items, LIMITS))]


@pytest.mark.parametrize("policies", [["none", "h2o(ratio=0.5,decode_budget=24)+quant(bits=4,group=8)"],
                                      ["none", "kivi(bits=2,group=4,residual=4)"],
                                      # the random control: its row seed came from the row's place in its batch
                                      ["none", "random(ratio=0.5)", "random(ratio=0.5,decode_budget=20)"]])
def test_items_of_different_answer_lengths_in_one_batch_equal_their_runs_alone(tmp_path, policies):
    model, items = tiny_llama(), _mixed_items()
    alone = evaluate_policies(model, CharTok(), items, specs_of(policies), tmp_path / "alone", "org/M", batch_size=1, fidelity=True)
    mixed = evaluate_policies(model, CharTok(), items, specs_of(policies), tmp_path / "mixed", "org/M", batch_size=len(items),
                              fidelity=True)
    for one, many in zip(alone, mixed):
        assert _records(one) == _records(many)
    # Each answer is as long as its own item allows (no EOS here), not as the batch's longest.
    for record, limit in zip(_records(alone[0]), LIMITS):
        assert len(record["answer"]) == limit
        assert record["metrics"]["tokens_seen"] == record["length"] + limit - 1  # the last token is never fed back
    fidelity_alone, fidelity_mixed = read_fidelity(alone[1]), read_fidelity(mixed[1])
    assert {k: f.positions for k, f in fidelity_alone.items()} == {k: f.positions for k, f in fidelity_mixed.items()}
    assert [fidelity_alone[it.id].positions for it in items] == LIMITS


def test_generate_takes_one_limit_per_prompt():
    model, tok = tiny_llama(), CharTok()
    prompts = [Prompt(tok(it.context)["input_ids"], tok(it.question)["input_ids"]) for it in _mixed_items()]
    alone = [generate(model, tok, [p], parse_policy("window(size=16)"), max_new_tokens=n)[0].token_ids for p, n in zip(prompts, LIMITS)]
    assert [len(t) for t in alone] == LIMITS
    batched = generate(model, tok, prompts, parse_policy("window(size=16)"), max_new_tokens=LIMITS, batch_size=3)
    assert [r.token_ids for r in batched] == alone
    many = generate_many(model, tok, prompts, [parse_policy("none"), parse_policy("window(size=16)")], max_new_tokens=LIMITS, batch_size=3)
    assert [r.token_ids for r in many["window(size=16)"]] == alone


@pytest.mark.parametrize("limits", [[2, 3], [2, 0, 1, 1, 1], [2.0] * 5, "7", [True] * 5, None])
def test_a_wrong_limit_is_refused_in_one_line(limits):
    model, tok = tiny_llama(), CharTok()
    prompts = [Prompt(tok(it.context)["input_ids"], tok(it.question)["input_ids"]) for it in _mixed_items()]
    with pytest.raises(UsageError, match="max_new_tokens"):
        generate(model, tok, prompts, parse_policy("none"), max_new_tokens=limits, batch_size=2)


def _ids(n, seed):
    return torch.randint(3, 128, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# Query-aware runs keep the question out of selection, so after the prefill a row may hold more than the policy
# keeps while decoding (window 20: 20 context tokens and the question's); its first decode step drops the excess.
@pytest.mark.parametrize("spec", ["window(size=20)", "streaming(sink=4,window=16)", "h2o(ratio=0.5,decode_budget=18)",
                                  "tova(ratio=0.5,decode_budget=18)", "random(ratio=0.5,decode_budget=18)",
                                  "h2o(ratio=0.5,adaptive=true,decode_budget=18)",
                                  "h2o(ratio=0.5,decode_budget=18)+quant(bits=4,group=8)"])
def test_a_row_ended_by_eos_before_its_first_step_keeps_its_cache_while_the_batch_decodes(spec):
    """A row whose first token is EOS holds what its prefill kept, alone; in a batch, the other rows' decode steps
    give it no token and must not evict from it either (they did: its bytes depended on the batch around it)."""
    model = tiny_llama()
    prompts = [Prompt(_ids(n, 100 + n), _ids(q, 7 + q)) for n, q in ((41, 3), (26, 5), (33, 4))]
    first = generate(model, CharTok(), prompts[:1], parse_policy(spec), max_new_tokens=1, mode="query")[0]
    model.generation_config.eos_token_id = first.token_ids[0]  # row 0 ends before any decode step
    alone = generate(model, CharTok(), prompts, parse_policy(spec), max_new_tokens=8, mode="query", batch_size=1)
    assert alone[0].token_ids == [] and alone[0].stats.kv_bytes == first.stats.kv_bytes
    assert any(len(r.token_ids) > 2 for r in alone[1:])  # the others decode (and evict) past it
    for batch_size in (3, 2):
        together = generate(model, CharTok(), prompts, parse_policy(spec), max_new_tokens=8, mode="query", batch_size=batch_size)
        for a, b in zip(alone, together):
            assert a.token_ids == b.token_ids
            assert (a.stats.kv_bytes, a.stats.kept_tokens) == (b.stats.kv_bytes, b.stats.kept_tokens), spec


@pytest.mark.parametrize("argv, message", [(["--n", "0"], "--n 0"), (["--batch-size", "0"], "--batch-size 0")])
def test_eval_refuses_no_items_or_a_batch_of_none_in_one_line(tmp_path, capsys, argv, message):
    """--n 0 was an internal TypeError ("this is a bug"); --batch-size 0 failed with range()'s own message."""
    from kveval.commands.main import main

    assert main(["eval", "--policy", "none", "--out", str(tmp_path / "out"), *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0] and "internal error" not in err[0]
    assert not (tmp_path / "out").exists()


def test_evaluate_policies_refuses_a_batch_size_below_one_before_any_run_folder(tmp_path):
    with pytest.raises(UsageError, match="batch_size=0"):
        evaluate_policies(tiny_llama(), CharTok(), _mixed_items(), specs_of(["none"]), tmp_path / "out", "org/M", batch_size=0)
    assert not (tmp_path / "out").exists()
