"""The memory-confusion taxonomy: a crafted answer for every category, precedence and value parsing."""

from __future__ import annotations

import pytest

from kveval.probes import CATEGORIES, ProbeItem, Score, category_metrics, generate_items, score_answer
from kveval.probes.scoring import extract_values


@pytest.fixture(scope="module")
def tok():
    from kveval.modeling.sources import load_tokenizer

    return load_tokenizer("smollm2-135m")


@pytest.fixture(scope="module")
def multikey(tok):
    return generate_items("niah_multikey", tok, 512, 1, depths=[0.5])[0]


@pytest.fixture(scope="module")
def update(tok):
    return generate_items("update_stream", tok, 512, 1, depths=[0.75])[0]


def _values(item, role):
    return [n.value for n in item.needles if n.role == role]


def check(item: ProbeItem, answer: str, category: str) -> Score:
    result = score_answer(item, answer)
    assert result.category == category, (answer, result)
    assert result.correct == (category == "correct")
    assert 0.0 <= result.score <= 1.0
    return result


def test_correct(multikey):
    gold = multikey.gold[0]
    for answer in (f" {gold}.", f"{gold}", f" The special magic number is {gold}. {gold}!",
                   f" {int(gold):,}"):
        r = check(multikey, answer, "correct")
        assert r.score == 1.0 and r.recalled is None


def test_distractor(multikey):
    other = _values(multikey, "distractor")[0]
    r = check(multikey, f" {other}.", "distractor")
    assert r.recalled == f"distractor:{other}" and r.score == 0.0


def test_stale(update):
    stale = _values(update, "stale")
    assert len(stale) == 2
    r = check(update, f" {stale[0]}", "stale")
    assert r.recalled == f"stale:{stale[0]}"
    # stale wins over a distractor in the same answer
    r = check(update, f" {_values(update, 'distractor')[0]} or {stale[-1]}", "stale")


def test_partial_truncated_and_near_miss(multikey):
    gold = multikey.gold[0]
    r = check(multikey, f" {gold[:5]}", "partial")
    assert r.recalled == f"partial:{gold[:5]}"
    assert r.detail["near"]["prefix"] == 5 and r.detail["near"]["gold"] == gold
    wrong_last = gold[:-1] + str((int(gold[-1]) + 1) % 10)
    r = check(multikey, f" {wrong_last}", "partial")
    assert r.detail["near"]["prefix"] == 6 and r.detail["near"]["similarity"] >= 0.8
    r = check(multikey, f" {gold}9", "partial")  # a superstring is not the value either
    assert r.score == 0.0


def test_over_inclusion(multikey):
    gold = multikey.gold[0]
    others = _values(multikey, "distractor")
    r = check(multikey, " " + ", ".join([others[0], gold, others[1]]), "over_inclusion")
    assert r.score == pytest.approx(1 / 3)
    assert r.recalled == f"distractor:{others[0]},distractor:{others[1]}"
    # the target plus a value found nowhere is still not a clean answer
    r = check(multikey, f" {gold} and 1234321", "over_inclusion")
    assert r.recalled == "fabricated:1234321" and r.score == 0.5


def test_fabricated(multikey):
    r = check(multikey, " 5550123", "fabricated")
    assert r.recalled == "fabricated:5550123" and r.detail["in_context"] is False and r.score == 0.0


def test_empty_is_an_answer_that_says_nothing(multikey):
    for answer in ("", "   ", "\n\n", " ...", " \u2014"):
        r = check(multikey, answer, "empty")
        assert r.score == 0.0 and r.recalled is None


def test_no_value_is_an_answer_that_says_something_else(multikey):
    """An answer with text but no value of the item's shape was ``empty``, which the README defines as answering
    nothing (SmolLM2 under streaming writes "a very important part of the grass...")."""
    for answer in (" I don't know.", " 42", " The number for that key is not given.",
                   " a very important part of the grass and the sky", " _x_"):
        r = check(multikey, answer, "no_value")
        assert r.score == 0.0 and r.recalled is None


def test_precedence_distractor_over_partial(multikey):
    gold = multikey.gold[0]
    other = _values(multikey, "distractor")[0]
    check(multikey, f" {gold[:5]} or {other}", "distractor")


def test_multivalue_fraction(tok):
    item = generate_items("niah_multivalue", tok, 512, 1, depths=[0.5])[0]
    gold = item.gold
    assert len(gold) == 4
    r = check(item, " " + ", ".join(gold), "correct")
    r = check(item, " " + ", ".join(gold[:2]), "partial")
    assert r.score == 0.5 and r.detail["found"] == 2 and r.detail["required"] == 4 and r.recalled is None
    r = check(item, " " + ", ".join(gold[:3]) + ", 1212121", "partial")
    assert r.score == pytest.approx(3 / 5)


def test_multiquery_confusion(tok):
    item = generate_items("niah_multiquery", tok, 512, 1, depths=[0.5])[0]
    other = _values(item, "distractor")[0]
    check(item, " " + ", ".join(item.gold), "correct")
    r = check(item, f" {item.gold[0]}, {other}", "distractor")
    assert r.score == pytest.approx(1 / 3)
    check(item, " " + ", ".join(item.gold + [other]), "over_inclusion")


def test_kv_retrieval_uuid(tok):
    item = generate_items("kv_retrieval", tok, 768, 1, depths=[0.5])[0]
    gold = item.gold[0]
    target_key = next(n.key for n in item.needles if n.role == "target")
    check(item, f' "{gold}"', "correct")
    check(item, f" {gold.upper()}", "correct")
    check(item, f' "{_values(item, "distractor")[0]}"', "distractor")
    r = check(item, f" {gold[:23]}", "partial")
    assert r.detail["near"]["prefix"] == 23
    check(item, f' "{target_key}"', "no_value")  # echoing the asked key is no answer
    check(item, " 00000000-1111-4222-8333-444444444444", "fabricated")


def test_variable_tracking_names(tok):
    item = generate_items("variable_tracking", tok, 768, 1, depths=[0.25])[0]
    names = item.gold
    check(item, " " + " ".join(names), "correct")
    check(item, " " + ", ".join(names[:-1]), "partial")
    other = _values(item, "distractor")[0]
    check(item, " " + ", ".join(names + [other]), "over_inclusion")
    check(item, f" {other}", "distractor")
    check(item, " QQQQQ", "fabricated")
    assert extract_values(" VAR ABCDE, and the Value", item) == ["ABCDE"]


def test_word_values(tok):
    item = generate_items("niah_single", tok, 512, 1, depths=[0.5], value_kind="word")[0]
    gold = item.gold[0]
    key = next(n.key for n in item.needles if n.role == "target")
    check(item, f" {gold}.", "correct")
    check(item, f" The special magic word for {key} is {gold}. I hope this helps!", "correct")
    check(item, f" {gold}s", "correct")  # its plural is the word
    r = check(item, " zeppelin", "fabricated")
    assert r.recalled == "fabricated:zeppelin"
    check(item, " Sorry, I cannot answer that.", "no_value")


def test_word_items_are_scored_like_the_other_kinds(tok):
    """Word values were the one kind where a hedge with another value scored correct, a refusal with a
    contraction was an invented value, and an unrelated word that looks like the gold was a near miss."""
    item = generate_items("niah_single", tok, 512, 1, depths=[0.5], value_kind="word")[0]
    gold = item.gold[0]
    other = next(w for w in ("elephant", "koala", "banjo") if w != gold)
    for hedge in (f" {gold} or maybe {other}", f" {other} or maybe {gold}"):  # both were "correct", score 1
        r = check(item, hedge, "over_inclusion")
        assert r.score == 0.5 and r.recalled == f"fabricated:{other}"
    for refusal in (" I don't know.", " I could not find it.", " The passage doesn't mention it.",
                    " I do not have enough information.", " Unfortunately it isn't stated."):
        check(item, refusal, "no_value")  # "don", "find", "doesn", "enough": fabricated
    typo = gold[:-1] + ("x" if gold[-1] != "x" else "y")
    assert check(item, f" {typo}", "partial").detail["near"]["value"] == typo
    cello = ProbeItem.from_dict({**item.to_dict(), "gold": ["cello"], "needles": [
        {**n, "value": "cello"} if n["role"] == "target" else n for n in item.to_dict()["needles"]]})
    check(cello, " Hello! I do not remember.", "no_value")  # "partial:hello"
    check(cello, " guitar", "fabricated")  # another value of the vocabulary, not a near miss of "cello"


def test_formatting_of_a_right_value_is_not_a_wrong_answer(tok):
    """UUIDs without dashes or with typographic ones, variable names in lower case, and numbers grouped by
    dots or apostrophes were scored wrong; a number beside another ("98997 100") is not glued into one."""
    kv = generate_items("kv_retrieval", tok, 768, 1, depths=[0.5])[0]
    uuid = kv.gold[0]
    check(kv, " " + uuid.replace("-", ""), "correct")
    check(kv, " " + uuid.replace("-", "\u2013"), "correct")
    vt = generate_items("variable_tracking", tok, 768, 1, depths=[0.25])[0]
    check(vt, " " + " ".join(name.lower() for name in vt.gold), "correct")
    check(vt, " " + " ".join(name.title() for name in vt.gold), "correct")
    single = generate_items("niah_single", tok, 512, 1, depths=[0.5])[0]
    g = single.gold[0]
    for grouped in (f"{g[0]}.{g[1:4]}.{g[4:]}", f"{g[0]}'{g[1:4]}'{g[4:]}", f"{g[0]},{g[1:4]},{g[4:]}", f"{g[0]} {g[1:4]} {g[4:]}"):
        check(single, f" {grouped}.", "correct")
    passkey = generate_items("passkey", tok, 512, 1, depths=[0.5])[0]
    assert extract_values(f" {passkey.gold[0]} 100%", passkey) == [passkey.gold[0], "100"]


def test_multi_turn_previous_answer_is_distractor(tok):
    items = generate_items("multi_turn", tok, 768, 1, depths=[0.5])
    turn1 = items[1]
    assert items[0].gold[0] in turn1.question
    r = check(turn1, f" {items[0].gold[0]}", "distractor")
    assert r.recalled == f"distractor:{items[0].gold[0]}"
    check(turn1, f" {turn1.gold[0]}", "correct")
    # A value the question holds only inside a longer one is no echo of it (it was dropped: "no_value"); cut short,
    # the previous turn's value is still the wrong needle.
    check(turn1, f" {items[0].gold[0][:4]}", "distractor")


def test_every_category_has_an_answer(multikey, update):
    gold = multikey.gold[0]
    crafted = {
        "correct": (multikey, gold),
        "distractor": (multikey, _values(multikey, "distractor")[0]),
        "stale": (update, _values(update, "stale")[0]),
        "partial": (multikey, gold[:4]),
        "over_inclusion": (multikey, f"{gold} {_values(multikey, 'distractor')[1]}"),
        "fabricated": (multikey, "9090909"),
        "no_value": (multikey, "no idea"),
        "empty": (multikey, " "),
    }
    assert set(crafted) == set(CATEGORIES)
    for category, (item, answer) in crafted.items():
        metrics = category_metrics(check(item, answer, category))
        assert metrics[f"cat_{category}"] == 1.0
        assert sum(metrics[f"cat_{c}"] for c in CATEGORIES) == 1.0
        assert metrics["correct"] == float(category == "correct")


def test_score_validation():
    with pytest.raises(ValueError):
        Score(0.5, False, "confused")
    with pytest.raises(ValueError):
        Score(1.5, True, "correct")


# --- near misses of the wrong needle: the confusion is which needle, not how well it was copied ----------------

def _one_digit_off(value: str) -> str:
    return value[:-1] + str((int(value[-1]) + 1) % 10)


def test_near_miss_of_a_distractor_is_a_distractor(multikey):
    """A garbled copy of another key's value (one digit off, or cut short) names the wrong needle: the model
    retrieved the distractor. It was ``fabricated``, as if the value came from nowhere."""
    other = _values(multikey, "distractor")[0]
    for garbled in (_one_digit_off(other), other[:5], other + "9"):
        r = check(multikey, f" {garbled}.", "distractor")
        assert r.recalled == f"distractor:{garbled}" and r.score == 0.0
        assert r.detail["near_needles"][0]["needle"] == other and r.detail["near_needles"][0]["role"] == "distractor"


def test_near_miss_of_a_stale_value_is_stale(update):
    stale = _values(update, "stale")[0]
    r = check(update, f" {stale[:-1]}", "stale")
    assert r.recalled == f"stale:{stale[:-1]}" and r.score == 0.0


def test_near_miss_nearer_the_gold_stays_partial(multikey):
    """A value near both the gold and a needle counts for the one it is nearer; the gold's near miss keeps its
    share of the score out of the penalty, as before."""
    gold = multikey.gold[0]
    r = check(multikey, f" {_one_digit_off(gold)}", "partial")
    assert r.detail["near"]["gold"] == gold and "near_needles" not in r.detail


def test_near_miss_of_a_distractor_uuid_and_variable(tok):
    item = generate_items("kv_retrieval", tok, 512, 1, depths=[0.5])[0]
    other = _values(item, "distractor")[0]
    r = check(item, f" {other[:-4]}", "distractor")  # the wrong UUID, its last digits lost
    assert r.recalled == f"distractor:{other[:-4]}"
    check(item, " 0123abcd-0000-4000-8000-00000000ffff", "fabricated")  # near no needle at all


def test_near_miss_of_a_distractor_in_a_full_answer_is_named(multikey):
    """Every gold value plus a garbled other needle: over-inclusion, the extra named by the needle it copies."""
    gold, other = multikey.gold[0], _values(multikey, "distractor")[0]
    r = check(multikey, f" {gold} and {_one_digit_off(other)}", "over_inclusion")
    assert r.recalled == f"distractor:{_one_digit_off(other)}" and r.score == 0.5


def test_a_value_as_near_the_found_gold_as_a_distractor_is_not_named_the_distractor(multikey):
    """In a full answer, an extra value equally near the gold (found) and a distractor counts for the gold, as a
    tie does where the gold is missing: it is no evidence of the wrong needle."""
    from dataclasses import replace

    from kveval.probes.item import Needle

    item = replace(multikey, gold=["482137"], needles=[Needle("a", "482137", "target", (0, 1)),
                                                       Needle("b", "482130", "distractor", (2, 3))])
    r = check(item, " 482137 or 482138", "over_inclusion")
    assert r.recalled == "fabricated:482138"
    r = check(item, " 482137 or 482139", "over_inclusion")
    assert r.recalled == "fabricated:482139"
    r = check(item, " 482137 or 48213", "over_inclusion")  # contained in both: a tie, the gold's
    assert r.recalled == "fabricated:48213"
    r = check(item, " 482138", "partial")  # the gold missing: the same tie goes to the gold
