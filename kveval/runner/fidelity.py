"""Fidelity of a compressed model to its baseline: the baseline's own answer, teacher-forced.

Accuracy moves only once compression changes a greedy answer. Long before
that, it changes the next-token distributions. For every item, the answer the
baseline (policy ``none``) gives greedily is fed token by token through the
compressed model, with the same prompt, mode, seed and policy cache, and at
each answer position ``t`` the two next-token distributions ``P_t`` (baseline)
and ``Q_t`` (compressed) are compared:

* ``kl_mean``, ``kl_max``: mean and largest ``KL(P_t || Q_t)`` over the
  positions, in nats;
* ``top1_agreement``: share of positions where ``argmax P_t == argmax Q_t``;
* ``answer_logprob_delta``: ``sum_t log Q_t(a_t) - sum_t log P_t(a_t)``, the
  change of the baseline answer's log-probability (nats; negative: the
  compressed model finds the baseline's answer less likely).

The answer's positions are every generated token, the EOS token included when
the baseline stopped on it (so an empty answer still has one position). Tokens
are fed one per forward pass, exactly as generation feeds them, so residual
windows and decode budgets age the cache as they do while generating.

Cost: the baseline's distributions (``positions x vocab`` floats per item) are
too large to store, so they are recomputed, once per item per evaluation call
and shared by every candidate of that call: one greedy pass under ``none`` per
item plus one teacher-forced pass per candidate and item, each about as costly
as generating the answer. Each candidate run folder gets ``fidelity.jsonl``
(one :class:`FidelityItem` per line, resumable); :func:`attach_fidelity` joins
it to the candidate's items when runs are compared.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

from kveval.errors import ResultFileError, UsageError

#: Per-candidate file of per-item fidelity measurements, next to ``items.jsonl``.
FIDELITY_FILE = "fidelity.jsonl"
#: Key of an item's fidelity measurements in ``ItemRecord.metrics`` once attached.
METRIC_KEY = "fidelity"
#: Per-item fields summarized by :func:`summarize`, in display order.
FIELDS = ("kl_mean", "kl_max", "top1_agreement", "answer_logprob_delta")


@dataclass
class FidelityItem:
    """One item's teacher-forced comparison of a candidate with the baseline.

    Attributes
    ----------
    id, hash, task : str
        The item (as in ``items.jsonl``; ``hash`` is the prompt hash).
    positions : int
        Answer positions compared (baseline answer tokens, EOS included).
    kl_mean, kl_max : float
        Mean and largest per-position ``KL(baseline || candidate)``, nats.
    top1_agreement : float
        Share of positions whose argmax tokens agree, in [0, 1].
    baseline_logprob, candidate_logprob : float
        Log-probability (nats) of the baseline answer under each model.
    answer_logprob_delta : float
        ``candidate_logprob - baseline_logprob``.
    """

    id: str
    hash: str
    task: str
    positions: int
    kl_mean: float
    kl_max: float
    top1_agreement: float
    baseline_logprob: float
    candidate_logprob: float
    answer_logprob_delta: float


# ----------------------------------------------------------------------------- distributions


def answer_distributions(model, tokenizer, prompts: list, policy, *, answers: "list[list[int]] | None" = None,
                         max_new_tokens: "int | list[int]" = 32, mode: str = "context", seed: "int | list[int]" = 0,
                         kv_dtype=None):
    """Next-token log-distributions along an answer, for one batch of prompts.

    With ``answers=None`` the answer is the greedy one under ``policy`` (the
    baseline pass: its own answer, EOS included when it stopped on EOS, at
    most ``max_new_tokens`` tokens, one limit for all rows or one per row); otherwise each row's given answer is
    teacher-forced. Padding is declared to the cache as
    :func:`kveval.runner.generation.generate` declares it, so a row's result does
    not depend on the batch it ran in.

    Returns
    -------
    list of (list of int, torch.Tensor)
        Per row: the answer ids and the float32 log-probabilities ``[positions, vocab]``
        of the distribution before each answer token.
    """
    import torch

    from kveval.cache.compressed import CompressedCache
    from kveval.runner.generation import check_request, eos_ids, forward_rows, prefill_prompts, row_limits

    limits = row_limits(max_new_tokens, len(prompts)) if answers is None else [len(a) for a in answers]
    check_request(model, prompts, [max(1, n) for n in limits], mode, len(prompts))
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = eos_ids(model, tokenizer)
    with torch.no_grad():
        cache = CompressedCache(model, policy, seed=seed, kv_dtype=kv_dtype)
        last, seen = prefill_prompts(model, cache, prompts, mode, pad_id)
        if mode == "context" and any(p.question for p in prompts):
            logits, mask = forward_rows(model, cache, [p.question for p in prompts], seen, pad_id)
            last = torch.where(mask[:, -1:], logits[:, -1].float(), last)
        steps = max(limits, default=0)
        ids: list[list[int]] = [[] for _ in prompts] if answers is None else [list(a) for a in answers]
        rows: list[list[torch.Tensor]] = [[] for _ in prompts]
        done = [answers is not None and not a for a in (answers or [None] * len(prompts))]
        for step in range(steps):
            log_probs = torch.log_softmax(last, dim=-1)
            feed: list[list[int]] = []
            for b in range(len(prompts)):
                if done[b]:
                    feed.append([])
                    continue
                rows[b].append(log_probs[b].cpu())
                if answers is None:
                    ids[b].append(int(log_probs[b].argmax()))
                token = ids[b][step]
                done[b] = token in eos or step + 1 >= limits[b]
                feed.append([] if done[b] else [token])
            if all(done):
                break
            logits, _ = forward_rows(model, cache, feed, seen, pad_id)
            last = logits[:, -1].float()
    return [(ids[b], torch.stack(rows[b]) if rows[b] else torch.empty(0)) for b in range(len(prompts))]


def compare_distributions(answer: Sequence[int], baseline, candidate) -> dict[str, float]:
    """Per-item fidelity numbers from two ``[positions, vocab]`` log-probability tensors along ``answer``.

    KL is computed in float64 and only where the baseline probability is
    positive; identical inputs give exactly 0 and agreement 1.
    """
    import torch

    if baseline.shape != candidate.shape or baseline.shape[0] != len(answer) or not len(answer):
        raise ValueError(f"fidelity: distributions {tuple(baseline.shape)} and {tuple(candidate.shape)} do not match "
                         f"an answer of {len(answer)} tokens")
    p_log, q_log = baseline.double(), candidate.double()
    p = p_log.exp()
    terms = torch.where(p > 0, p * (p_log - q_log), torch.zeros_like(p))
    kl = terms.sum(dim=-1).clamp(min=0.0)  # float rounding can give -1e-12 for equal distributions
    index = torch.tensor(list(answer), dtype=torch.long)[:, None]
    base_lp = float(p_log.gather(1, index).sum())
    cand_lp = float(q_log.gather(1, index).sum())
    return {"positions": len(answer), "kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
            "top1_agreement": float((p_log.argmax(-1) == q_log.argmax(-1)).double().mean()),
            "baseline_logprob": base_lp, "candidate_logprob": cand_lp, "answer_logprob_delta": cand_lp - base_lp}


# ----------------------------------------------------------------------------- run folders


def read_fidelity(run_dir: str | os.PathLike) -> dict[str, FidelityItem]:
    """``{item id: FidelityItem}`` of a candidate run folder (empty when it has no ``fidelity.jsonl``).

    A half-written last line (a killed run) is ignored; any other bad line is
    a :class:`ResultFileError` naming the file and line.
    """
    path = Path(run_dir) / FIDELITY_FILE
    out: dict[str, FidelityItem] = {}
    if not path.is_file():
        return out
    lines = path.read_text().splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = FidelityItem(**json.loads(line))
        except (ValueError, TypeError) as exc:
            if number == len(lines) and not path.read_text().endswith("\n"):
                break  # the line a killed run was writing: measured again on resume
            raise ResultFileError(f"{path}:{number}: not a fidelity record ({exc}); delete the file to measure again") from None
        out[item.id] = item
    return out


def record_fidelity(model, tokenizer, items: list, baseline, candidates: "Sequence[tuple[object, Path]]", *,
                    batch_size: int = 1, seed: int = 0) -> None:
    """Write ``fidelity.jsonl`` into each candidate's run folder (items already there are skipped).

    Parameters
    ----------
    items : list of probe items
        As given to :func:`kveval.runner.evaluate.evaluate_policies`.
    baseline : RunSpec
        The baseline's spec (policy ``none``); its mode and KV dtype are the candidates'.
    candidates : sequence of (RunSpec, Path)
        Each candidate's spec and run folder.
    """
    from kveval.runner.generation import Prompt
    from kveval.probes import encode_item

    done = {d: read_fidelity(d) for _, d in candidates}
    for d in done:
        _cut_partial_line(Path(d) / FIDELITY_FILE)
    pending = [it for it in items if any(it.id not in done[d] or done[d][it.id].hash != it.hash for _, d in candidates)]
    kwargs = baseline.generation_kwargs()
    for first in range(0, len(pending), batch_size):
        batch = pending[first:first + batch_size]
        prompts = [Prompt(*encode_item(tokenizer, item)) for item in batch]
        seeds = [it.random_seed(seed) for it in batch]  # the items' own, as their answers had
        reference = answer_distributions(model, tokenizer, prompts, baseline.policy,
                                         max_new_tokens=[it.max_new_tokens for it in batch], seed=seeds, **kwargs)
        answers = [ids for ids, _ in reference]
        for spec, run_dir in candidates:
            todo = [b for b, it in enumerate(batch) if it.id not in done[run_dir] or done[run_dir][it.id].hash != it.hash]
            if not todo:
                continue
            forced = answer_distributions(model, tokenizer, prompts, spec.policy, answers=answers, seed=seeds, **kwargs)
            with open(Path(run_dir) / FIDELITY_FILE, "a") as fh:
                for b in todo:
                    numbers = compare_distributions(answers[b], reference[b][1], forced[b][1])
                    record = FidelityItem(id=batch[b].id, hash=batch[b].hash, task=batch[b].family, **numbers)
                    fh.write(json.dumps(asdict(record)) + "\n")


def _cut_partial_line(path: Path) -> None:
    if path.is_file():
        text = path.read_text()
        if text and not text.endswith("\n"):
            path.write_text(text[: text.rfind("\n") + 1])


def attach_fidelity(run_dir: str | os.PathLike, records: Iterable) -> int:
    """Put each record's fidelity numbers (``fidelity.jsonl`` in ``run_dir``) into ``record.metrics["fidelity"]``.

    Only records whose prompt hash matches are joined. Returns how many were.
    """
    found = read_fidelity(run_dir) if Path(run_dir).is_dir() else {}
    joined = 0
    for record in records:
        item = found.get(record.id)
        if item is not None and item.hash == record.hash:
            record.metrics[METRIC_KEY] = {k: getattr(item, k) for k in FIELDS}
            joined += 1
    return joined


# ----------------------------------------------------------------------------- statistics


def kl_bounds(values: Sequence[float], alpha: float = 0.05, n_resamples: int = 9999, seed: int = 0) -> tuple[float, float]:
    """One-sided ``1 - alpha`` lower and upper bounds of the mean per-item KL (bootstrap percentiles; nats).

    Values that are all equal (one item, or ``none`` against itself) have no
    spread: both bounds are that value. An empty list gives ``(0, inf)``:
    nothing shown either way.
    """
    x = np.asarray(values, dtype=float)
    if x.size == 0:
        return 0.0, math.inf
    if np.all(x == x[0]):
        return float(x[0]), float(x[0])
    rng = np.random.default_rng(seed)
    means = x[rng.integers(0, x.size, size=(n_resamples, x.size))].mean(axis=1)
    return float(np.quantile(means, alpha)), float(np.quantile(means, 1 - alpha))


def fidelity_values(records: Iterable, key: str = "kl_mean") -> list[float]:
    """The attached per-item ``key`` (one of :data:`FIELDS`) of the records that have fidelity measurements."""
    return [r.metrics[METRIC_KEY][key] for r in records if METRIC_KEY in r.metrics]


def summarize(records: Iterable, alpha: float = 0.05, seed: int = 0) -> dict[str, float] | None:
    """Mean per-item fidelity numbers of ``records`` (their attached ``metrics["fidelity"]``), or ``None`` if none has them.

    Keys: ``n``, the means of :data:`FIELDS`, ``kl_max_item`` (largest
    per-position KL of any item), ``kl_mean_lower`` and ``kl_mean_upper``
    (the one-sided ``1 - alpha`` bootstrap bounds of the mean per-item ``kl_mean``).
    """
    rows = [r.metrics[METRIC_KEY] for r in records if METRIC_KEY in r.metrics]
    if not rows:
        return None
    out: dict[str, float] = {"n": len(rows)}
    for key in FIELDS:
        out[key] = float(np.mean([row[key] for row in rows]))
    out["kl_max_item"] = float(max(row["kl_max"] for row in rows))
    out["kl_mean_lower"], out["kl_mean_upper"] = kl_bounds([row["kl_mean"] for row in rows], alpha, seed=seed)
    return out


def items_to_separate(a: Sequence[float], b: Sequence[float], test: str, *, power: float = 0.8, alpha: float = 0.05,
                      sizes: Sequence[int] = (5, 10, 15, 20, 30, 40, 60, 80, 120, 160, 240, 320, 480, 640, 1000),
                      n_resamples: int = 400, seed: int = 0) -> int | None:
    """Smallest item count in ``sizes`` at which a paired test separates ``a`` from ``b`` in ``power`` of resamples.

    ``a``, ``b``: per-item values of two policies on the same items (0/1
    correctness for ``test="mcnemar"``, per-item ``kl_mean`` for
    ``test="wilcoxon"``, signed-rank with the normal approximation). Items are
    resampled with replacement to each size; a resample counts when the
    two-sided test gives ``p < alpha``. Returns
    ``None`` when even the largest size does not reach ``power``.
    """
    from scipy import stats as st

    x, y = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    if x.shape != y.shape or x.size == 0:
        raise UsageError("items_to_separate: give two equally long, non-empty per-item lists")
    if test not in ("mcnemar", "wilcoxon"):
        raise UsageError(f"items_to_separate: test={test!r}; use 'mcnemar' or 'wilcoxon'")
    rng = np.random.default_rng(seed)
    for n in sizes:
        pick = rng.integers(0, x.size, size=(n_resamples, n))
        xa, yb = x[pick], y[pick]
        if test == "mcnemar":  # exact two-sided McNemar: binomial on the discordant pairs
            k, m = np.sum((xa > 0.5) & (yb < 0.5), axis=1), np.sum((xa < 0.5) & (yb > 0.5), axis=1)
            p = np.minimum(1.0, 2 * st.binom.cdf(np.minimum(k, m), k + m, 0.5))
            p[k + m == 0] = 1.0
        else:
            d = yb - xa
            p = np.ones(n_resamples)
            moved = np.any(d != 0, axis=1)
            if moved.any():  # the normal approximation: scipy's small-n default with ties is a slow permutation test
                with np.errstate(invalid="ignore", divide="ignore"):
                    p[moved] = np.asarray(st.wilcoxon(d[moved], axis=1, method="approx").pvalue, dtype=float)
            p[np.isnan(p)] = 1.0
        if np.sum(p < alpha) >= power * n_resamples:
            return int(n)
    return None
