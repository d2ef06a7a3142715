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
(:mod:`kveval.runs.fidelity`, resumable), joined to the candidate's items when runs are compared
(:func:`kveval.runs.fidelity.attach_fidelity`) and summarized by :mod:`kveval.stats.fidelity`.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Sequence

from kveval.cache.compressed import CompressedCache
from kveval.probes import encode_item
from kveval.runner import generation  # generation.prefill_prompts, looked up when called (tests stand a spy in)
from kveval.runner.generation import (
    Prompt,
    check_request,
    eos_ids,
    forward_rows,
    reconstruct_and_compress,
    row_limits,
)
from kveval.runner.runspec import check_mode
from kveval.runs.fidelity import FIDELITY_FILE, FidelityItem, cut_partial_line, read_fidelity

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


    limits = row_limits(max_new_tokens, len(prompts)) if answers is None else [len(a) for a in answers]
    check_request(model, prompts, [max(1, n) for n in limits], mode, len(prompts))
    check_mode(policy, mode)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    eos = eos_ids(model, tokenizer)
    with torch.no_grad():
        cache = CompressedCache(model, policy, seed=seed, kv_dtype=kv_dtype)
        last, seen = generation.prefill_prompts(model, cache, prompts, mode, pad_id)
        if cache.awaiting_reconstruction:  # KVzip's reconstruction forwards, as generate runs them
            reconstruct_and_compress(model, tokenizer, cache, [p.context for p in prompts], pad_id)
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
    done = {d: read_fidelity(d) for _, d in candidates}
    for d in done:
        cut_partial_line(Path(d) / FIDELITY_FILE)
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


