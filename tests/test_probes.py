"""Recall probe generation: determinism, exact lengths, depths, needle spans, CLI and lm-eval tasks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kveval.probes import CATEGORIES, FAMILIES, Cell, ProbeItem, encode_item, generate_grid, generate_items, grid, score_answer
from kveval.probes.text import prose_sentences

REPO = Path(__file__).resolve().parent.parent
TASKS = REPO / "tasks"


@pytest.fixture(scope="module")
def plain_tok():
    """The same tokenizer without a chat template (a base model's)."""
    from kveval.modeling.sources import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    tokenizer.chat_template = None
    tokenizer.kveval_name = "smollm2-135m-plain"
    return tokenizer


def _dump(items):
    return "\n".join(json.dumps(i.to_dict(), sort_keys=True) for i in items)


VARIANTS = [(f, {}) for f in FAMILIES] + [
    ("niah_single", {"haystack": "prose", "value_kind": "word"}),
    ("niah_single", {"value_kind": "uuid"}),
    ("niah_multikey", {"haystack": "needles"}),
    ("multi_turn", {"haystack": "prose"}),
    ("variable_tracking", {"haystack": "prose"}),
]

_CACHE: dict = {}


def _items(tok, family, length, params, n=5):
    key = (family, length, json.dumps(params, sort_keys=True), n)
    if key not in _CACHE:
        _CACHE[key] = generate_items(family, tok, length, n, seed=0, **params)
    return _CACHE[key]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_same_seed_identical_other_seed_different(tok, family):
    a = generate_items(family, tok, 512, 3, seed=7)
    b = generate_items(family, tok, 512, 3, seed=7)
    c = generate_items(family, tok, 512, 3, seed=8)
    assert _dump(a) == _dump(b)
    assert _dump(a) != _dump(c)
    assert [i.id.replace("-s7-", "-s8-") for i in a] == [i.id for i in c]
    assert {i.hash for i in a}.isdisjoint({i.hash for i in c})


@pytest.mark.parametrize("length", [512, 2048])
@pytest.mark.parametrize("family,params", VARIANTS, ids=[f"{f}{p or ''}" for f, p in VARIANTS])
def test_length_within_two_percent(tok, family, params, length):
    items = _items(tok, family, length, params)
    for item in items:
        context_ids, question_ids = encode_item(tok, item)
        assert len(context_ids) + len(question_ids) == item.length
        assert item.length <= length
        last_turn = item.turn == item.params.get("num_turns", 1) - 1
        if last_turn:  # multi_turn fits its longest (last) turn; earlier turns lack some history
            assert item.length >= 0.98 * length, (item.id, item.length)


@pytest.mark.parametrize("family,params", VARIANTS, ids=[f"{f}{p or ''}" for f, p in VARIANTS])
def test_depth_within_one_sentence(tok, family, params):
    for length in (512, 2048):
        for item in _items(tok, family, length, params):
            needle_tokens = max(n.span[1] - n.span[0] for n in item.needles)
            sentence = 8
            if params.get("haystack") == "prose":
                sentence = max(len(tok(" " + s, add_special_tokens=False)["input_ids"]) for s in prose_sentences())
            tolerance = needle_tokens + sentence  # one haystack sentence, or a neighbouring needle in the way
            if family == "update_stream":  # stale values must precede the latest one
                tolerance += (item.params["num_updates"] - 1) * needle_tokens
            if family == "recite_list":  # the list's words precede its last, the primary needle
                tolerance += (item.params["num_items"] - 1) * needle_tokens
            if item.turn > 0:  # later turns' keys sit at random depths, pushed around by clustered needles
                tolerance += len(item.needles) * needle_tokens
            error_tokens = abs(item.depth_actual - item.depth) * item.length
            assert error_tokens <= tolerance, (item.id, item.depth, item.depth_actual)


@pytest.mark.parametrize("family,params", VARIANTS, ids=[f"{f}{p or ''}" for f, p in VARIANTS])
def test_needle_spans_point_at_needles(tok, family, params):
    for item in _items(tok, family, 512, params):
        context_ids, question_ids = encode_item(tok, item)
        ids = context_ids + question_ids
        assert tok.decode(ids) == item.prompt_context + item.prompt_question
        assert all(n.span[1] <= len(context_ids) for n in item.needles)
        for needle in item.needles:
            text = tok.decode(ids[needle.span[0]:needle.span[1]])
            assert needle.value in text, (item.id, needle, text)
        assert sorted(n.span for n in item.needles) == [n.span for n in item.needles]
        assert set(item.gold) <= {n.value for n in item.needles if n.role == "target"}
        assert score_answer(item, " " + ", ".join(item.gold) + ".").correct


def test_prompt_parts_and_round_trip(tok):
    item = generate_items("niah_multikey", tok, 512, 1, depths=[0.5])[0]
    assert item.prompt_context.startswith("<|im_start|>system") and item.prompt_context.endswith(item.context)
    assert item.prompt_question.startswith("\n\n" + item.question)
    assert item.prompt_question.endswith("<|im_start|>assistant\n" + item.answer_prefix)
    assert item.text == item.context + "\n\n" + item.question
    assert item.id == "niah_multikey-512-0.50-s0-0" and item.group == item.id and item.turn == 0
    assert [n.role for n in item.needles].count("target") == 1
    assert [n.role for n in item.needles].count("distractor") == 3
    again = ProbeItem.from_dict(json.loads(json.dumps(item.to_dict())))
    assert again == item
    assert item.max_new_tokens >= 16


def test_no_chat_template(plain_tok):
    items = generate_items("passkey", plain_tok, 512, 2)
    for item in items:
        assert item.prompt_context == item.context
        assert item.prompt_question == "\n\n" + item.question + " " + item.answer_prefix
        assert 0.98 * 512 <= item.length <= 512
        assert "The pass key is" in item.context


def test_passkey_wording(tok):
    item = generate_items("passkey", tok, 512, 1, depths=[0.5])[0]
    key = item.gold[0]
    assert f"The pass key is {key}. Remember it. {key} is the pass key." in item.context
    assert "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again." in item.context
    assert len(key) == 5 and key.isdigit()


def test_update_stream_roles_and_order(tok):
    for item in generate_items("update_stream", tok, 1024, 5):
        stale = [n for n in item.needles if n.role == "stale"]
        target = [n for n in item.needles if n.role == "target"]
        assert len(stale) == item.params["num_updates"] - 1 and len(target) == 1
        assert all(n.key == target[0].key and n.span[0] < target[0].span[0] for n in stale)
        assert item.gold == [target[0].value]


def test_variable_tracking_chain(tok):
    for item in generate_items("variable_tracking", tok, 1024, 5):
        targets = [n for n in item.needles if n.role == "target"]
        assert [n.value for n in targets] == item.gold  # chain order kept
        assert len(item.gold) == item.params["num_hops"] + 1
        value = targets[0].key
        assert f"VAR {item.gold[0]} = {value}." in item.context
        for prev, nxt in zip(item.gold, item.gold[1:]):
            assert f"VAR {nxt} = VAR {prev}." in item.context


def test_kv_retrieval_json(tok):
    item = generate_items("kv_retrieval", tok, 1024, 1, depths=[0.5])[0]
    start = item.context.index("{")
    data = json.loads(item.context[start:])
    target = next(n for n in item.needles if n.role == "target")
    assert data[target.key] == item.gold[0] and len(data) == len(item.needles)
    assert target.key in item.question


def test_multi_turn_shares_context(tok):
    items = generate_items("multi_turn", tok, 1024, 2)
    assert len(items) == 2 * 3
    groups = {}
    for item in items:
        groups.setdefault(item.group, []).append(item)
    for group in groups.values():
        assert [i.turn for i in group] == [0, 1, 2]
        assert len({i.prompt_context for i in group}) == 1
        assert len({i.id for i in group}) == 3
        for k, item in enumerate(group):
            for earlier in group[:k]:
                assert earlier.gold[0] in item.question  # history with gold answers
                assert earlier.answer_prefix.replace("The special magic number for ", "").split()[0] in item.question
            assert item.gold[0] not in item.question
            roles = {n.value: n.role for n in item.needles}
            assert roles[item.gold[0]] == "target"
            assert all(roles[e.gold[0]] == "distractor" for e in group if e is not item)
        assert group[0].length < group[1].length < group[2].length


def test_grid_cells(tok):
    cells = list(grid([512, 1024], [0.0, 0.5, 1.0]))
    assert cells[0] == Cell(512, 0.0) and len(cells) == 6
    items = generate_grid("passkey", tok, [512, 1024], [0.0, 0.5, 1.0], n_per_cell=2)
    for cell in cells:
        assert sum(cell.contains(i) for i in items) == 2
    with pytest.raises(ValueError):
        list(grid([512], [1.5]))


def test_bad_inputs(tok):
    with pytest.raises(ValueError, match="valid families: passkey"):
        generate_items("nope", tok, 512, 1)
    with pytest.raises(ValueError, match="unknown parameter"):
        generate_items("passkey", tok, 512, 1, num_distractors=3)
    with pytest.raises(ValueError, match="haystack"):
        generate_items("passkey", tok, 512, 1, haystack="needles")
    with pytest.raises(ValueError, match="more than"):
        generate_items("niah_multikey", tok, 64, 1)
    with pytest.raises(ValueError, match="depth"):
        generate_items("passkey", tok, 512, 1, depths=[2.0])


def test_cli_writes_loadable_jsonl(tok, tmp_path, capsys):
    import datasets

    from kveval.commands.main import main
    from kveval.probes.item import read_probe_items

    out = tmp_path / "probes.jsonl"
    rc = main(["probes", "--family", "passkey", "--family", "niah_multikey", "--length", "512", "--length", "768",
               "--n", "2", "--depth", "0", "1", "--seed", "3", "--out", str(out)])
    assert rc == 0
    items = read_probe_items(out)
    assert len(items) == 2 * 2 * 2
    assert {i.depth for i in items} == {0.0, 1.0}
    ds = datasets.load_dataset("json", data_files=str(out), split="train", cache_dir=str(tmp_path / "hf"))
    assert len(ds) == 8 and ds[0]["id"] == items[0].id
    expected = generate_items("passkey", tok, 512, 2, depths=[0, 1], seed=3)
    assert items[0].hash == expected[0].hash
    rc = main(["probes", "--family", "all", "--n", "1", "--length", "512", "--out", str(tmp_path / "all.jsonl")])
    assert rc == 0 and len(read_probe_items(tmp_path / "all.jsonl")) == len(FAMILIES) + 2 + 3  # multi_turn: 3 turns; system_rules: 4 requests
    assert main(["probes", "--family", "bogus", "--out", str(tmp_path / "x.jsonl")]) == 2
    err = capsys.readouterr().err
    assert "valid families:" in err and "passkey" in err
    # No items asked for is a mistake, not an empty file written with exit 0.
    assert main(["probes", "--family", "passkey", "--n", "0", "--out", str(tmp_path / "none.jsonl")]) == 2
    assert "--n 0" in capsys.readouterr().err and not (tmp_path / "none.jsonl").exists()


def test_cli_unknown_family_raises():
    import argparse

    from kveval.commands import probes as cli

    parser = argparse.ArgumentParser()
    cli.configure(parser)
    args = parser.parse_args(["--family", "bogus"])
    with pytest.raises(ValueError, match=r"^unknown probe family 'bogus'; valid families: .*multi_turn"):
        cli.run(args)


def test_lm_eval_tasks_load_from_other_cwd(tmp_path, monkeypatch):
    from lm_eval.tasks import TaskManager

    monkeypatch.chdir(tmp_path)
    tm = TaskManager(include_path=[str(TASKS)], include_defaults=False, metadata={"n": 1, "length": 512})
    names = [f"kveval_{f}" for f in FAMILIES] + ["kveval_niah_multikey_mc", "kveval_kv_retrieval_mc"]
    assert set(names) <= set(tm.all_tasks)
    assert {"kveval_probes", "kveval_probes_mc"} <= set(tm.all_groups)
    loaded = tm.load(["kveval_probes", "kveval_probes_mc"])
    tasks = loaded["tasks"]
    assert set(loaded["groups"]) == {"kveval_probes", "kveval_probes_mc"}
    assert set(names) <= set(tasks)
    for name in names:
        task = tasks[name]
        docs = list(task.test_docs())
        assert docs, name
        doc = docs[0]
        text = task.doc_to_text(doc)
        assert "<|im_start|>" not in text and text == doc["context"] + "\n\n" + doc["question"]
        assert doc["length"] <= 512
        if task.OUTPUT_TYPE == "multiple_choice":
            choices = task.doc_to_choice(doc)
            assert choices[task.doc_to_target(doc)] == doc["gold"][0]
            assert set(choices) <= {n["value"] for n in doc["needles"]} and len(choices) >= 2
        else:
            metrics = task.process_results(doc, [" " + ", ".join(doc["gold"]) + "."])
            assert metrics["score"] == 1.0 and metrics["cat_correct"] == 1.0
            assert task.process_results(doc, [""])["cat_empty"] == 1.0
            assert task.process_results(doc, [" I don't know."])["cat_no_value"] == 1.0
            # every category the scorer gives is a metric the task aggregates (lm-eval refuses one it does not)
            assert {f"cat_{c}" for c in CATEGORIES} <= set(task.aggregation()), name


# --- one prompt encoder (generate and eval build the same ids) ------------------------------------

@pytest.mark.parametrize("question", ["What is the pass key?", "pass key", "Which number follows 7?\nAnswer briefly."])
def test_generate_and_probes_encode_the_same_prompt_identically(tok, plain_tok, question):
    """``kveval generate`` (encode_prompt) and ``kveval eval`` (PromptFrame + encode_item) give identical ids."""
    from kveval.probes.item import PromptFrame, encode_parts
    from kveval.runner.generation import encode_prompt

    context = "The pass key is 7342. Remember it. The grass is green. The pass key is 7342."
    for tokenizer in (tok, plain_tok):
        frame = PromptFrame.for_tokenizer(tokenizer)
        probe = encode_parts(tokenizer, *frame.render(context, question, ""))
        prompt = encode_prompt(tokenizer, context, question)
        assert (prompt.context, prompt.question) == probe
        assert question in tokenizer.decode(prompt.question) and question not in tokenizer.decode(prompt.context)[-len(question) - 2:]


def test_encode_prompt_without_question_keeps_the_whole_message_as_context(tok):
    from kveval.runner.generation import encode_prompt

    prompt = encode_prompt(tok, "Tell me a story.")
    text = tok.decode(prompt.context)
    assert text.endswith("Tell me a story.") and "<|im_start|>assistant" in tok.decode(prompt.question)
