"""A long system prompt shared by several requests (``system_rules``): the prompt is prefilled and compressed once,
each request continues from its own copy, and the answers, log-probabilities and bytes are those of one prefill
per request, exactly; the prefix's bytes are counted once per prompt; the gate clusters a prompt's requests."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest
import torch
from test_run_folders import CharTok

import kveval.runner.generation as generation
import kveval.runner.prefixes as prefixes
from kveval.cache.compressed import CompressedCache
from kveval.policies.spec import parse_policy
from kveval.probes import encode_item, generate_items, score_answer
from kveval.probes.prompts import PromptFrame
from kveval.probes.shared_prompt import INTRO
from kveval.runner.evaluate import evaluate_policies
from kveval.runner.generation import Prompt, generate, generate_many
from kveval.runner.prefixes import plan_prefixes
from kveval.runner.runspec import RunSpec
from kveval.runs.records import iter_items, read_run_info
from kveval.stats.comparison import compare_pairs

from cache_runs import fingerprint, random_prompts
from tiny_models import Tok, tiny_gemma3, tiny_llama

#: Deterministic policies of each kind (none, selections with and without a decode budget, a quantization, a
#: stack) and the seeded control, on a Llama; the Gemma 3 (sliding layers) gets a selection of them.
CASES = [(tiny_llama, spec) for spec in ("none", "snapkv(ratio=0.5,window=4)", "h2o(ratio=0.5,decode_budget=30)",
                                         "kivi(bits=2,group=4,residual=8)",
                                         "snapkv(ratio=0.5,window=4)+quant(bits=4,group=8)", "random(ratio=0.5)")]
CASES += [(tiny_gemma3, spec) for spec in ("none", "snapkv(ratio=0.5,window=4)", "h2o(ratio=0.5,decode_budget=30)",
                                           "random(ratio=0.5)")]
TIMINGS = ("ttft_s", "decode_tokens_per_s")


def _shared_prompts() -> list[Prompt]:
    """Two system prompts: rows 0, 2, 3 share the first, row 1 has the second; questions of different lengths."""
    systems = random_prompts([(60, 1), (40, 1)], 3)
    questions = random_prompts([(1, 4), (1, 6), (1, 2), (1, 5)], 4)
    return [Prompt(systems[s].context, q.question) for s, q in zip([0, 1, 0, 0], questions)]


def _unshared(monkeypatch):
    """Make every row prefill its own context again (the per-row path)."""
    monkeypatch.setattr(generation, "plan_prefixes", lambda prompts, mode, seeds, seeded: prefixes.PrefixPlan(
        tuple(range(len(prompts))), tuple(range(len(prompts)))))


def _prefill_rows(monkeypatch) -> list[int]:
    """Rows of every prefill run from now on (the spy records ``len(prompts)`` of each)."""
    rows, real = [], generation.prefill_prompts

    def spy(model, cache, prompts, mode, pad_id):
        rows.append(len(prompts))
        return real(model, cache, prompts, mode, pad_id)

    monkeypatch.setattr(generation, "prefill_prompts", spy)
    return rows


def test_plan_groups_rows_by_context_and_by_seed_where_the_policy_reads_it():
    prompts = _shared_prompts()
    plan = plan_prefixes(prompts, "context", [5, 6, 7, 5], seeded=False)
    assert (plan.firsts, plan.index, plan.shares) == ((0, 1), (0, 1, 0, 0), True)
    seeded = plan_prefixes(prompts, "context", [5, 6, 7, 5], seeded=True)  # row 2's seed differs: its own prefix
    assert (seeded.firsts, seeded.index) == ((0, 1, 2), (0, 1, 2, 0))
    assert not plan_prefixes(prompts, "query", [0] * 4, seeded=False).shares  # the question is in the prefill


@pytest.mark.parametrize("make, spec", CASES, ids=[f"{m.__name__}-{s}" for m, s in CASES])
def test_a_shared_prefix_gives_the_per_row_answers_exactly(make, spec, monkeypatch):
    model, stack, prompts = make(), parse_policy(spec), _shared_prompts()
    kwargs = dict(max_new_tokens=[5, 3, 6, 4], batch_size=4, seed=[7, 8, 7, 7])
    rows = _prefill_rows(monkeypatch)
    shared = generate(model, Tok(), prompts, stack, **kwargs)
    many = generate_many(model, Tok(), prompts, [parse_policy("none"), stack], **kwargs)[stack.spec]
    assert rows and set(rows) == {2}  # one prefill per system prompt, in both drivers
    del rows[:]
    one = generate(model, Tok(), prompts, stack, **{**kwargs, "batch_size": 1})
    _unshared(monkeypatch)
    own = generate(model, Tok(), prompts, stack, **kwargs)
    assert rows == [1, 1, 1, 1, 4]  # batch size 1, then the per-row path: no prefill shared
    for s, m, o, alone in zip(shared, many, own, one):
        assert fingerprint(s) == fingerprint(m) == fingerprint(o)  # tokens, log-probabilities, bytes, kept tokens
        assert s.prefix_stats == m.prefix_stats == o.prefix_stats
        # Batch 1 against batch 4: the same tokens and bytes (log-probabilities to float rounding, as every batch)
        assert fingerprint(s)[1:2] + fingerprint(s)[3:] == fingerprint(alone)[1:2] + fingerprint(alone)[3:]
        assert s.prefix_stats == alone.prefix_stats
        assert s.logprobs == pytest.approx(alone.logprobs, abs=1e-5)
    # Requests never see each other's tokens: the rows of one prompt processed their own question and answer only.
    for p, r, limit in zip(prompts, shared, kwargs["max_new_tokens"]):
        assert r.stats.tokens_seen == [p.length + limit - 1]
        assert r.prefix_stats.tokens_seen == [len(p.context)]


@pytest.mark.parametrize("spec", ["none", "snapkv(ratio=0.5,window=4)", "kivi(bits=2,group=4,residual=8)"])
def test_prefix_bytes_are_the_compressed_contexts_bytes(spec):
    """What a shared prefix reports is what a cache holding the context alone, compressed, measures."""
    model, stack, prompts = tiny_llama(), parse_policy(spec), _shared_prompts()
    results = generate(model, Tok(), prompts, stack, max_new_tokens=3, batch_size=4)
    for p, r in zip(prompts, results):
        cache = CompressedCache(model, stack)
        with torch.no_grad():
            generation.prefill_prompts(model, cache, [Prompt(p.context)], "context", 0)
        assert r.prefix_stats == cache.stats(row=0)
        assert 0 < r.prefix_stats.kv_bytes < r.stats.kv_bytes
    assert len({r.prefix_stats.kv_bytes for r in results}) == 2  # two prompts of different lengths


# --- the family on a tiny model: records, run.json, the gate's clusters ------------------------------

def _family_items(n=2, requests=3):
    return generate_items("system_rules", CharTok(), 700, n, depths=[0.25], num_requests=requests, num_distractors=0)


def test_items_of_one_prompt_share_context_group_and_seed():
    items = _family_items()
    assert len(items) == 6 and len({i.group for i in items}) == 2
    for group in {i.group for i in items}:
        members = [i for i in items if i.group == group]
        assert [i.turn for i in members] == [0, 1, 2]
        assert len({i.prompt_context for i in members}) == 1 and len({i.id for i in members}) == 3
        assert len({i.random_seed(0) for i in members}) == 1  # one prompt, one prefix for the random control
        for item in members:
            assert item.params["system_prompt"] is True and item.prompt_context.startswith(INTRO)
            key = item.answer_prefix.removeprefix("Code of ").removesuffix(":")
            assert item.question == f"What is the code of {key}?" and f"Code of {key}: {item.gold[0]}." in item.context
            roles = {n.value: n.role for n in item.needles}
            assert roles[item.gold[0]] == "target"
            assert all(roles[other.gold[0]] == "distractor" for other in members if other is not item)
            other = next(o for o in members if o is not item)
            assert score_answer(item, f" {other.gold[0]}.").category == "distractor"
            assert score_answer(item, f" {item.gold[0]}.").correct
    assert len({i.random_seed(0) for i in items}) == 2


def _evaluate(tmp_path, items, batch_size, specs=("none", "snapkv(ratio=0.5,window=4)", "random(ratio=0.5)")):
    model = tiny_llama()
    model.generation_config.eos_token_id = None
    return evaluate_policies(model, CharTok(), items, [RunSpec.parse(s) for s in specs], tmp_path, "tiny",
                             batch_size=batch_size)


def _records(run_dir):
    out = []
    for r in iter_items(run_dir):
        d = json.loads(json.dumps(r.__dict__, default=str))
        d["metrics"] = {k: v for k, v in d["metrics"].items() if k not in TIMINGS}
        out.append(d)
    return out


def test_run_counts_each_prompt_once_and_batches_agree(tmp_path):
    items = _family_items()
    shared = _evaluate(tmp_path / "b6", items, batch_size=6)
    alone = _evaluate(tmp_path / "b1", items, batch_size=1)
    for s, a in zip(shared, alone):
        assert _records(s) == _records(a)  # every field of every record, timings aside
    model = tiny_llama()
    for run_dir, spec in zip(shared, ("none", "snapkv(ratio=0.5,window=4)", "random(ratio=0.5)")):
        records = list(iter_items(run_dir))
        groups = {}
        for r in records:
            groups.setdefault(r.metrics["group"], []).append(r)
        assert len(groups) == 2
        prefixes, totals = [], []
        for item_group, members in groups.items():
            prefix = {r.metrics["prefix_kv_bytes"] for r in members}
            assert len(prefix) == 1  # one prefix per prompt
            for r in members:
                assert r.metrics["prefix_kv_bytes"] + r.metrics["request_kv_bytes"] == r.metrics["kv_bytes"]
            # the measured prefix is the per-row path's context, compressed: its own cache, nothing shared
            item = next(i for i in items if i.group == item_group)
            cache = CompressedCache(model, parse_policy(spec), seed=item.random_seed(0))
            with torch.no_grad():
                generation.prefill_prompts(model, cache, [Prompt(encode_item(CharTok(), item)[0])], "context", 0)
            assert prefix == {cache.stats(row=0).kv_bytes}
            prefixes.append(prefix.pop())
            totals.append(prefixes[-1] + sum(r.metrics["request_kv_bytes"] for r in members))
        info = read_run_info(run_dir).extra["shared_prefix"]
        assert info["groups"] == 2 and info["requests"] == 6
        assert info["prefix_kv_bytes_mean"] == np.mean(prefixes) and info["group_kv_bytes_mean"] == np.mean(totals)
        assert info["kv_bytes_per_request"] == sum(totals) / 6
        assert info["unshared_kv_bytes_per_request"] == np.mean([r.metrics["kv_bytes"] for r in records])
        assert info["kv_bytes_per_request"] < info["unshared_kv_bytes_per_request"]


def test_a_prefix_each_request_changes_is_not_held_once(tmp_path):
    """A decode budget evicts prefix tokens in each request's copy, and a residual window codes the prefix's newest
    tokens there: no server holds such a prefix once. Their runs say why, count each request's own cache for the
    prompt, and the shared figure equals the unshared one; a plain quantizer's prefix is held once."""
    items = _family_items()
    specs = ("h2o(ratio=0.5,decode_budget=40)", "kivi(bits=4,group=4,residual=8)", "quant(bits=8,group=8)")
    for run_dir, spec in zip(_evaluate(tmp_path, items, batch_size=6, specs=specs), specs):
        records = list(iter_items(run_dir))
        info = read_run_info(run_dir).extra["shared_prefix"]
        if spec.startswith("quant"):
            assert info["held_once"] and "not_held_once" not in info
            assert info["kv_bytes_per_request"] < info["unshared_kv_bytes_per_request"]
            continue
        assert not info["held_once"]
        assert ("decode budget" if spec.startswith("h2o") else "residual") in info["not_held_once"]
        groups = {}
        for r in records:
            groups.setdefault(r.metrics["group"], []).append(r.metrics["kv_bytes"])
        assert info["group_kv_bytes_mean"] == np.mean([sum(g) for g in groups.values()])
        assert info["kv_bytes_per_request"] == info["unshared_kv_bytes_per_request"] == np.mean(
            [r.metrics["kv_bytes"] for r in records])


def test_the_gate_takes_a_prompts_requests_for_one_cluster(tmp_path):
    items = _family_items(n=4, requests=3)
    base_dir, cand_dir = _evaluate(tmp_path, items, batch_size=8, specs=("none", "snapkv(ratio=0.5,window=4)"))
    base, cand = list(iter_items(base_dir)), list(iter_items(cand_dir))
    assert [r.metrics["group"] for r in base] == [i.group for i in items]
    # Scores as if whole prompts had regressed under the candidate: two of the four prompts, every request of each.
    lost = {items[0].group, items[6].group}
    base = [replace(r, score=1.0, correct=True) for r in base]
    cand = [replace(r, score=float(r.metrics["group"] not in lost), correct=r.metrics["group"] not in lost) for r in cand]
    c = compare_pairs(list(zip(base, cand)), cell="system_rules", task="system_rules")
    assert c.clusters == 4 and c.design_effect > 1 and c.test == "tango-clustered"
    ungrouped = [replace(r, metrics={**r.metrics, "group": r.id}) for r in base]
    independent = compare_pairs(list(zip(ungrouped, cand)), cell="system_rules", task="system_rules")
    assert independent.clusters == 12 and independent.test == "mcnemar"
    assert c.ci_low < independent.ci_low  # the clustered interval is the wider one


def test_the_leaderboard_shows_each_prompt_counted_once(tmp_path):
    import csv

    from kveval.report.leaderboard import build_report

    dirs = _evaluate(tmp_path, _family_items(n=2, requests=2), batch_size=4, specs=("none", "snapkv(ratio=0.5,window=4)"))
    build_report(dirs, tmp_path / "report", n_resamples=100)
    markdown = (tmp_path / "report" / "leaderboard.md").read_text()
    rows = {r["policy"]: r for r in csv.DictReader(open(tmp_path / "report" / "leaderboard.csv"))}
    assert "## Shared prefixes" in markdown
    for run_dir in dirs:
        info = read_run_info(run_dir)
        shared = info.extra["shared_prefix"]
        assert float(rows[info.policy]["shared_prefix_kv_bytes_per_request"]) == shared["kv_bytes_per_request"]
        assert (f"| tiny | {info.policy} | 2 | 4 | yes | {shared['prefix_kv_bytes_mean']:,.0f} | "
                f"{shared['group_kv_bytes_mean']:,.0f} | {shared['kv_bytes_per_request']:,.0f} | "
                f"{shared['unshared_kv_bytes_per_request']:,.0f} |") in markdown


# --- the prompt frame ----------------------------------------------------------------------------

def test_the_prompt_is_the_system_message_where_the_template_has_one(tok):
    item = generate_items("system_rules", tok, 512, 1)[0]
    assert item.prompt_context == "<|im_start|>system\n" + item.context
    assert item.prompt_question == ("<|im_end|>\n<|im_start|>user\n" + item.question
                                    + "<|im_end|>\n<|im_start|>assistant\n" + item.answer_prefix)
    assert item.context.startswith(INTRO)
    context_ids, question_ids = encode_item(tok, item)
    assert len(context_ids) + len(question_ids) == item.length <= 512


def test_without_a_system_role_the_prompt_opens_the_user_message(tok):
    template = tok.chat_template
    try:
        tok.chat_template = ("{% for m in messages %}{% if m['role'] == 'system' %}"
                                  "{{ raise_exception('System role not supported') }}{% endif %}"
                                  "<u>{{ m['content'] }}</u>{% endfor %}<a>")
        assert PromptFrame.for_system(tok) == PromptFrame.for_tokenizer(tok)
        tok.chat_template = None
        assert PromptFrame.for_system(tok) == PromptFrame("", "\n\n", " ", False)
    finally:
        tok.chat_template = template
