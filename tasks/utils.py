"""lm-evaluation-harness glue for the kveval recall probes (``tasks/kveval_*.yaml``).

Docs come from :func:`kveval.probes.generate_items` through ``custom_dataset``
(never from cwd-relative data files). Everything the generator takes can be set
with lm-eval metadata, e.g.::

    lm_eval ... --include_path tasks --tasks kveval_probes \\
        --metadata '{"tokenizer": "smollm2-135m", "length": [512, 1024], "n": 20, "seed": 0}'

Metadata keys: ``tokenizer`` (else the model args' ``pretrained``, else
``"smollm2-135m"``), ``length`` (int or list, default 512), ``n`` (contexts per
length, default 20), ``seed`` (0), ``depths`` (list in [0, 1]) and any family
parameter such as ``haystack`` or ``value_kind`` (applied to the families that take it).
Docs hold the raw text (``input``: context, blank line, question) and the answer
prefix (``gen_prefix``); lm-eval applies the chat template itself.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

try:
    import kveval
except ImportError:  # a source checkout used through --include_path without installing kveval
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kveval.probes import FAMILIES, ProbeItem, category_metrics, generate_items, score_answer  # noqa: E402

DEFAULT_TOKENIZER = "smollm2-135m"
DEFAULT_LENGTH = 512
DEFAULT_N = 20
MC_CHOICES = 4


@functools.lru_cache(maxsize=4)
def _tokenizer(name: str):
    from kveval.modeling.sources import load_tokenizer

    tokenizer = load_tokenizer(name)
    tokenizer.kveval_name = name
    return tokenizer


def _tokenizer_name(meta: dict) -> str:
    for key in ("tokenizer", "pretrained"):
        value = meta.get(key)
        if isinstance(value, str) and value:
            return value
    return DEFAULT_TOKENIZER


def _as_list(value, cast):
    if value is None:
        return None
    if isinstance(value, (list, tuple)):
        return [cast(v) for v in value]
    if isinstance(value, str) and "," in value:
        return [cast(v) for v in value.split(",") if v.strip()]
    return [cast(value)]


def build_items(family: str, **meta) -> list[ProbeItem]:
    """Probe items for ``family`` from lm-eval metadata (see module docstring)."""
    lengths = _as_list(meta.get("length", meta.get("max_seq_lengths")), int) or [DEFAULT_LENGTH]
    n = int(meta.get("n", DEFAULT_N))
    seed = int(meta.get("seed", 0))
    depths = _as_list(meta.get("depths"), float)
    params = {k: v for k, v in meta.items() if k in FAMILIES[family].defaults and v is not None}
    tokenizer = _tokenizer(_tokenizer_name(meta))
    items: list[ProbeItem] = []
    for length in lengths:
        items.extend(generate_items(family, tokenizer, length, n, depths=depths, seed=seed, **params))
    return items


def _doc(item: ProbeItem) -> dict:
    doc = item.to_dict()
    doc["input"] = item.text
    doc["answer"] = ", ".join(item.gold)
    return doc


def _mc_doc(item: ProbeItem) -> dict:
    """Choices: the true value and up to MC_CHOICES-1 other in-context needle values (nearest first)."""
    import random

    doc = _doc(item)
    target = item.gold[0]
    anchor = next(n for n in item.needles if n.value == target).span[0]
    others = sorted((n for n in item.needles if n.value not in item.gold), key=lambda n: (abs(n.span[0] - anchor), n.value))
    choices = [target] + [n.value for n in others[: MC_CHOICES - 1]]
    random.Random(item.hash).shuffle(choices)
    doc["choices"] = choices
    doc["label"] = choices.index(target)
    return doc


def _dataset(docs: list[dict]):
    import datasets

    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})


def load(family: str | None = None, mc: bool = False, **kwargs):
    """``custom_dataset`` entry point: ``{"test": Dataset}`` of probe docs. ``kwargs`` is lm-eval's metadata."""
    family = family or kwargs.get("family")
    if family not in FAMILIES:
        raise ValueError(f"unknown probe family {family!r}; valid families: {', '.join(FAMILIES)}")
    items = build_items(family, **{k: v for k, v in kwargs.items() if k != "family"})
    return _dataset([_mc_doc(i) if mc else _doc(i) for i in items])


def _loader(family: str, mc: bool = False):
    def fn(**kwargs):
        return load(family, mc=mc, **kwargs)

    fn.__name__ = f"load_{family}{'_mc' if mc else ''}"
    return fn


load_passkey = _loader("passkey")
load_niah_single = _loader("niah_single")
load_niah_multikey = _loader("niah_multikey")
load_niah_multivalue = _loader("niah_multivalue")
load_niah_multiquery = _loader("niah_multiquery")
load_kv_retrieval = _loader("kv_retrieval")
load_variable_tracking = _loader("variable_tracking")
load_update_stream = _loader("update_stream")
load_multi_turn = _loader("multi_turn")
load_recite_list = _loader("recite_list")
load_state_trace = _loader("state_trace")
load_system_rules = _loader("system_rules")
load_niah_multikey_mc = _loader("niah_multikey", mc=True)
load_kv_retrieval_mc = _loader("kv_retrieval", mc=True)


def process_results(doc: dict, results: list[str]) -> dict[str, float]:
    """Score the generation with :func:`kveval.probes.score_answer`: score, correct and one 0/1 per category."""
    item = ProbeItem.from_dict(doc)
    answer = results[0] if results else ""
    return category_metrics(score_answer(item, answer))
