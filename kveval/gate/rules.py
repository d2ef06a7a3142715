"""Regression gate: may this compression policy be deployed instead of the baseline?

``kveval gate --baseline RUN --candidate RUN [...] [--config configs/gate.yaml] [--out DIR]``
compares each candidate with the baseline item by item (:mod:`kveval.stats.comparison`)
and gives every gated task one of three verdicts:

PASS
    Non-inferiority shown: the one-sided ``1 - alpha`` lower bound of the
    change lies above ``-margin`` and the net negative-flip rate is shown to be
    under its cap.
FAIL
    A loss larger than the margin shown (the upper bound below ``-margin``,
    Holm-adjusted across the family), or a regression rule broken with
    statistical support (the net right->wrong rate, or the share of
    items that were right at baseline and fell into a confusion category (of all
    the task's items), is shown to
    be above its cap).
INCONCLUSIVE
    Neither: too few items. The verdict names the items needed to decide at
    the observed discordance.

The change tested is the task's mean score (accuracy, on right/wrong items), by
Tango's score interval and tests on the items' discordances (:mod:`kveval.stats.paired`:
fractional on partial scores), or by the paired bootstrap for mostly graded tasks
of enough items (:func:`kveval.stats.comparison.uses_bootstrap`); the flip and
confusion rules read the ``correct`` flags. A candidate FAILs when any task fails, else
is INCONCLUSIVE when any task is, else PASSes. Exit codes
(:mod:`kveval.errors`): 0 PASS, 1 FAIL, 3 INCONCLUSIVE (0 with a warning when
``inconclusive_blocks: false``), 2 any error. ``--plan`` prints the items per
task needed instead; ``--gpu-memory/--context/--batch`` add the deployment
decision: which candidates' caches fit, and the most compressed one that PASSes. The command itself is
:mod:`kveval.commands.gate`; this module decides the verdicts, :mod:`kveval.gate.verdicts` holds them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from scipy import stats as _st

from kveval.errors import ResultFileError, UsageError
from kveval.gate import sequential as seq
from kveval.gate.config import GateConfig
from kveval.gate.verdicts import (
    _ORDER,
    ERROR,
    FAIL,
    INCONCLUSIVE,
    PASS,
    CandidateVerdict,
    GateResult,
    NoiseFloor,
    TaskVerdict,
    within_noise_floor,
)
from kveval.runs.results import expand_run_dirs, is_same_run, load_run, pair_runs, pairing_warnings, run_digest
from kveval.stats import fidelity, paired
from kveval.stats import significance as stats
from kveval.stats.comparison import (
    CONFUSION_CATEGORIES,
    OVERALL,
    Comparison,
    RunComparison,
    adjust_pvalues,
    compare_runs,
)
from kveval.stats.sequential import CONTINUE, LookDecision, decide
from kveval.stats.sequential import FAIL as SEQ_FAIL
from kveval.stats.sequential import PASS as SEQ_PASS

__all__ = [
    "evaluate_gate", "evaluate_sweep", "group_runs_by_baseline", "items_needed", "judge_sequential", "judge_task",
    "margin_test", "noise_floors", "repeated_confidence_level",
]


def confidence_label(alpha: float) -> str:
    """``1 - alpha`` as a percentage for a bound's label: ``95%`` at 0.05, ``99.99%`` at a sequential look's 8.9e-5
    (never rounded to 100%, which no bound has)."""
    level = (1 - alpha) * 100
    return f"{round(level)}%" if abs(level - round(level)) < 1e-9 else f"{min(level, 99.9999):.6g}%"


def _pct(x: float) -> str:
    return f"{x * 100:.1f}%"


# ----------------------------------------------------------------------------- judging one task


def margin_test(c: Comparison, margin: float, cfg: GateConfig) -> paired.MarginTest:
    """The task's change of mean score (accuracy, on 0/1 scores) against ``-margin``, by the comparison's own
    method: Tango's tests on the items' fractional discordances (:func:`kveval.stats.paired.score_discordance`), or the
    paired bootstrap for mostly graded tasks of enough items (:func:`kveval.stats.comparison.uses_bootstrap`)."""
    if c.ci_method == "bootstrap":
        return stats.bootstrap_margin_test(c.baseline_scores, c.candidate_scores, margin, alpha=cfg.alpha,
                                           n_resamples=cfg.n_resamples, seed=cfg.seed)
    de = c.design_effect
    return paired.margin_test(c.score_lost / de, c.score_gained / de, c.n / de, margin, cfg.alpha)


def _bootstrap_items(c: Comparison, t: paired.MarginTest, cfg: GateConfig) -> int | None:
    """Items a bootstrap-tested task needs at its observed per-item spread (read off its interval)."""
    gap = abs(t.delta + t.margin)
    if gap < 1e-12:
        return None
    sd = float(abs(t.upper - t.lower) / (2 * _st.norm.ppf(1 - cfg.alpha))) * c.n**0.5
    return math.ceil((float(_st.norm.ppf(1 - cfg.alpha) + _st.norm.ppf(cfg.power)) * sd / gap) ** 2)


def items_needed(c: Comparison, t: paired.MarginTest, score_open: bool, flip_cap: float | None,
                 cfg: GateConfig) -> int | None:
    """Items per task that would decide every open rule with ``cfg.power`` if the observed rates are the true ones,
    and more than the task has (``None``: a rule's change sits on its margin, no number decides it).

    ``score_open``: the mean score is not shown above ``-margin`` (Tango's rates, or a bootstrap-tested task's
    spread); ``flip_cap``: the net right->wrong rate is not shown under this cap.
    """
    needed = []
    if score_open:
        needed.append(_bootstrap_items(c, t, cfg) if c.ci_method == "bootstrap" else
                      paired.items_needed_approx(c.score_lost / c.n, c.score_gained / c.n, t.margin, cfg.alpha, cfg.power))
    if flip_cap is not None:
        needed.append(paired.items_needed_approx(c.n_regressed / c.n, c.n_improved / c.n, flip_cap, cfg.alpha, cfg.power))
    if any(n is None for n in needed):
        return None
    return max([c.n + 1, *(math.ceil(n * c.design_effect) for n in needed)])


def _summary(c: Comparison, t: paired.MarginTest) -> str:
    cats = c.regressed_categories()
    cat_text = ", ".join(f"{n} {k}" for k, n in cats.most_common())
    head = f"{c.task} regressed {c.n_regressed}/{c.n} items" + (f" ({cat_text})" if c.n_regressed and cats else "")
    if c.n_improved:
        head += f", improved {c.n_improved}"
    what = "accuracy" if c.binary else "mean score"
    bound = int(round((1 - 2 * t.alpha) * 100))
    how = "bootstrap" if c.ci_method == "bootstrap" else "Tango"
    return f"{head}, {what} {t.delta:+.3f} [{t.lower:+.3f},{t.upper:+.3f}] ({bound}% {how})"


def _lower_binomial(k: float, n: float, alpha: float) -> float:
    """One-sided ``1 - alpha`` Clopper-Pearson lower bound of a proportion ``k / n`` (effective counts may be
    fractional: the beta quantile takes them as they are)."""
    return 0.0 if k == 0 else float(_st.beta.ppf(alpha, k, n - k + 1))


def _confusion(c: Comparison, cfg: GateConfig, pairs) -> tuple[list[str], list[str]]:
    """Rule on items right at baseline that fell into a confusion category; shifts among already-wrong items are notes."""
    reasons: list[str] = []
    notes: list[str] = []
    if not cfg.max_confusion_increase or not pairs or not any(b.category for b, _ in pairs):
        return reasons, notes
    regressed: dict[str, int] = {}
    for b, x in pairs:
        if b.correct and not x.correct and x.category:
            regressed[x.category] = regressed.get(x.category, 0) + 1
    counts = dict(regressed)
    counts[OVERALL] = sum(v for k, v in regressed.items() if k in CONFUSION_CATEGORIES)
    for cat, k in counts.items():
        limit = cfg.confusion_limit(cat)
        if limit is None or k == 0:
            continue
        # shared contexts: the counts by the task's design effect, as the margin tests take them (Rao-Scott)
        low = _lower_binomial(k / c.design_effect, c.n / c.design_effect, cfg.alpha)
        if low > limit:
            label = "confusion (all categories)" if cat == OVERALL else cat
            reasons.append(
                f"{label}: {k} of {c.n} items were right at baseline ({_pct(k / c.n)} of the task, {confidence_label(cfg.alpha)} lower bound "
                f"{_pct(low)}) > {_pct(limit)}"
            )
    shifted = sum(1 for b, x in pairs if not b.correct and not x.correct and b.category != x.category)
    if shifted:
        notes.append(f"{shifted} item(s) wrong in both runs changed confusion category (reported, never fails)")
    return reasons, notes


def _kl_rule(c: Comparison, cfg: GateConfig, pairs) -> tuple[list[str], list[str]]:
    """The optional ``max_mean_kl`` rule: (FAIL reasons, INCONCLUSIVE reasons) of one task.

    FAIL when the one-sided ``1 - alpha`` lower bound of the mean per-item KL
    exceeds the cap; shown under the cap when its upper bound is below it.
    """
    cap = cfg.kl_limit(c.task)
    if cap is None:
        return [], []
    values = fidelity.fidelity_values(cand for _, cand in pairs)
    if len(values) < c.n:
        return [], [f"mean KL not measured on {c.n - len(values)} of {c.n} items: rerun with kveval eval --fidelity"]
    low, high = fidelity.kl_bounds(values, cfg.alpha, cfg.n_resamples, cfg.seed)
    level = confidence_label(cfg.alpha)[:-1]
    if low > cap:
        return [f"mean KL from the baseline {sum(values) / len(values):.4g} nats: {level}% lower bound {low:.4g} > cap {cap:g}"], []
    if not high < cap:
        return [], [f"mean KL not shown under {cap:g} nats ({level}% upper bound {high:.4g}): more items narrow the bound"]
    return [], []


def judge_task(c: Comparison, cfg: GateConfig, p_inferior_holm: float, test: paired.MarginTest, pairs=(),
               noise_floor: NoiseFloor | None = None, look: LookDecision | None = None) -> TaskVerdict:
    """Apply the rules of ``cfg`` to one task (``p_inferior_holm``: the task's FAIL test, adjusted over the family;
    ``noise_floor``: the baseline's own flips on the task under another batch arrangement, if measured).

    ``look``: a sequential gate's decision on the margin at this look (:func:`kveval.stats.sequential.decide`): it
    replaces the fixed-n margin tests (FAIL below the lower boundary, non-inferiority shown above the upper one);
    every other rule applies as it does at fixed n."""
    margin = test.margin
    reasons: list[str] = []
    pending: list[str] = []
    level = confidence_label(cfg.alpha)[:-1]
    if look is None and p_inferior_holm < cfg.alpha:
        reasons.append(
            f"loss beyond the margin: {level}% upper bound {test.upper:+.3f} < -margin {-margin:+.3f} (Holm p={p_inferior_holm:.3g})"
        )
    elif look is not None and look.status == SEQ_FAIL:
        reasons.append(f"loss beyond the margin: z {look.z:+.2f} <= {look.lower:+.2f}, the lower boundary at look "
                       f"{look.look + 1} ({look.n:g} items)")
    open_cap = None  # the flip cap, while the net flip rate is not shown under it
    cap = cfg.max_negative_flip_rate
    if cap is not None and cap > 0:
        de = c.design_effect
        net = paired.margin_test(c.n_regressed / de, c.n_improved / de, c.n / de, cap, cfg.alpha) if cap < 1 else None
        if net is not None and net.upper < -cap:
            reasons.append(
                f"net negative flips: ({c.n_regressed} - {c.n_improved})/{c.n} right->wrong, {level}% lower bound "
                f"{-net.upper:.3f} > cap {cap:g}"
            )
        elif net is not None and not net.lower > -cap:
            pending.append(f"net negative flip rate not shown under {cap:g} (upper bound {-net.lower:.3f})")
            open_cap = cap
    confusion_reasons, notes = _confusion(c, cfg, pairs)
    reasons += confusion_reasons
    kl_reasons, kl_pending = _kl_rule(c, cfg, pairs)
    reasons += kl_reasons
    pending += kl_pending
    score_open = not test.lower > -margin if look is None else look.status != SEQ_PASS
    if score_open and look is None:
        pending.insert(0, f"non-inferiority not shown: {level}% lower bound {test.lower:+.3f} <= -margin {-margin:+.3f}")
    elif score_open:
        pending.insert(0, f"non-inferiority not shown: z {look.z:+.2f} < {look.upper:+.2f}, the upper boundary at "
                          f"look {look.look + 1} ({look.n:g} items)")
    needed = None
    within_floor = within_noise_floor(c, noise_floor)
    if reasons and within_floor:  # what fired rests on flips the baseline makes against itself
        pending = [f"{reason} (but {c.n_regressed + c.n_improved} flips do not exceed the baseline's own "
                   f"{noise_floor.flips} under another batch arrangement: not shown harmful)" for reason in reasons] + pending
        reasons = []
    if reasons:
        status = FAIL
    elif pending:
        status = INCONCLUSIVE
        if score_open or open_cap is not None:  # the KL rule's own reasons say what it needs
            needed = items_needed(c, test, score_open, open_cap, cfg)
            pending.append(
                f"about {needed} items per task would decide at the observed discordance ({int(cfg.power * 100)}% power)"
                if needed is not None
                else "the observed change sits on the margin: no number of items decides it"
            )
        reasons = pending
    else:
        status = PASS
    if noise_floor is not None:
        differ = "1 answer differs" if noise_floor.answers == 1 else f"{noise_floor.answers} answers differ"
        notes.append(f"noise floor: the baseline run again in another batch arrangement flips {noise_floor.flips} of "
                     f"{noise_floor.n} items ({differ}); this candidate flips "
                     f"{c.n_regressed + c.n_improved}" + (" (within the floor)" if within_floor else ""))
    mdl = _min_detectable_loss(c, margin, cfg)
    return TaskVerdict(c.task, status, _summary(c, test), reasons, notes, margin, test, p_inferior_holm, needed, c,
                       mdl, noise_floor, look)


def _min_detectable_loss(c: Comparison, margin: float, cfg: GateConfig) -> float | None:
    """The task's minimum detectable loss (:attr:`TaskVerdict.min_detectable_loss`), on 0/1 and graded scores alike."""
    return paired.min_detectable_loss(c.n, c.score_gained / c.n, margin, cfg.alpha, cfg.power, c.design_effect)


def _judge_all(results: Sequence[GateResult], cfg: GateConfig) -> None:
    """Holm-adjust the FAIL tests over the configured family, then judge every candidate x gated task."""
    ok = [(r, v) for r in results for v in r.candidates if v.comparison is not None]
    tests = {
        (id(v), t): margin_test(v.comparison.task(t), cfg.margin_for(t), cfg) for r, v in ok for t in r.tasks
    }
    families = [[(id(v), t) for r, v in ok for t in r.tasks]] if cfg.family == "sweep" else [[(id(v), t) for t in r.tasks] for r, v in ok]
    holm: dict[tuple, float] = {}
    for fam in families:
        if fam:
            for key, p in zip(fam, stats.holm([tests[k].p_inferior for k in fam])):
                holm[key] = float(p)
    # the descriptive "any change" tests, adjusted over the same family
    if cfg.family == "sweep":
        adjust_pvalues([v.comparison.task(t) for r, v in ok for t in r.tasks])
    else:
        for r, v in ok:
            adjust_pvalues([v.comparison.task(t) for t in r.tasks])
    for r, v in ok:
        by_task: dict[str, list] = {}
        for pair in v.comparison.pairs:
            by_task.setdefault(pair[0].task, []).append(pair)
        v.tasks = [
            judge_task(v.comparison.task(t), cfg, holm[(id(v), t)], tests[(id(v), t)], by_task.get(t, []),
                       r.noise_floor.get(t)) for t in r.tasks
        ]
        v.status = max((t.status for t in v.tasks), key=_ORDER.__getitem__, default=PASS)


# ----------------------------------------------------------------------------- judging look by look


def repeated_confidence_level(cfg: GateConfig, plan: seq.LookPlan, look: int) -> float:
    """The two-sided level of the interval a sequential verdict reports at ``look``: a repeated confidence interval
    (Jennison and Turnbull 2000, chapter 9), the critical value of the design's boundary at that look for half of
    ``1 - confidence_level`` each side, so that the intervals of every look cover the true change together with
    ``confidence_level`` and the one at the look that stopped keeps it (a plain interval there would not: stopping
    where the statistic is extreme biases it). The widest over the tasks, whose looks may differ by an item."""
    tail = (1 - cfg.confidence_level) / 2
    z = max(cfg.sequential.design_of(d.looks, tail, tail).boundaries.upper[plan.design_look(t, look)]
            for t, d in plan.designs.items())
    return float(2 * _st.norm.cdf(z) - 1)


def cap_alpha(cfg: GateConfig, design, look: int) -> float:
    """The error rate the caps (flips, confusion, KL) are tested at in look ``look`` of a task's ``design``: the FAIL
    spending function's increment there, ``alpha(t_k) - alpha(t_(k-1))`` of the gate's ``alpha``. A cap tested at
    every look at the full ``alpha`` would FAIL a candidate sitting on it up to once per look; the increments sum to
    ``alpha`` over the looks, so a cap's FAIL keeps its fixed-n error rate by the union bound, and the last look of
    an O'Brien-Fleming design tests it almost as the fixed-n gate does."""
    spent = design.fail_spending.spent(np.asarray(design.fractions[:look + 1]), cfg.alpha)
    return float(spent[-1] - (spent[-2] if look else 0.0))


def judge_sequential(cfg: GateConfig, base, cand, tasks: Sequence[str], family: int, floor=None
                     ) -> tuple[str, list[TaskVerdict], RunComparison, dict[str, Any]]:
    """Judge one candidate look by look under ``cfg.sequential`` (:mod:`kveval.gate.sequential`).

    ``base``, ``cand``: loaded runs (the candidate may hold only the first blocks of the look order); ``tasks``: the
    gated tasks; ``family``: FAIL tests sharing ``alpha`` (:func:`kveval.gate.sequential.family_size`); ``floor``:
    the baseline's noise-floor run, if measured. Replays looks ``0, 1, ...`` up to the last the candidate and the
    baseline both hold, stopping at the first PASS or FAIL. Returns the candidate's status (PASS, FAIL,
    INCONCLUSIVE, or CONTINUE where it holds too few items to decide), its task verdicts and comparison at that
    look, and the record :attr:`~kveval.gate.verdicts.CandidateVerdict.sequential` carries.
    """
    alpha_fail = cfg.alpha / family
    order = seq.run_order(base)
    missing = [t for t in tasks if t not in order]
    if missing:
        raise ResultFileError(f"{base.path}: the look order has no task {missing[0]}")
    plan = seq.LookPlan.build(cfg.sequential, {t: order[t] for t in tasks}, cfg.alpha, alpha_fail, str(base.path))
    known = {i for ids in plan.order.values() for i in ids}
    held = {r.id for r in cand.items}
    stray = [r.id for r in cand.items if r.task in plan.order and r.id not in known]
    if stray:
        raise ResultFileError(f"{cand.path}: item {stray[0]} is not in the baseline's look order; pair runs of one "
                              f"sweep")
    try:
        reached, _ = plan.reached(held & {r.id for r in base.items})
    except ResultFileError as exc:
        raise ResultFileError(f"{cand.path}: {exc}") from None
    if reached < 0:
        first = plan.counts(0)
        raise ResultFileError(f"{cand.path}: holds fewer items than the first look needs ("
                              f"{', '.join(f'{n} of {t}' for t, n in first.items())}); run at least the first block")
    last = plan.looks - 1
    for k in range(reached + 1):
        ids = set(plan.ids_through(k))
        sub_base, sub_cand = seq.subset(base, ids), seq.subset(cand, ids)
        level = repeated_confidence_level(cfg, plan, k)
        rc = compare_runs(sub_base, sub_cand, confidence_level=level, n_resamples=cfg.n_resamples, seed=cfg.seed,
                          cells=False)
        floors = noise_floors(sub_base, seq.subset(floor, ids)) if floor is not None else {}
        by_task: dict[str, list] = {}
        for pair in rc.pairs:
            by_task.setdefault(pair[0].task, []).append(pair)
        verdicts = []
        for t in tasks:
            c = rc.task(t)
            margin = cfg.margin_for(t)
            test = margin_test(c, margin, cfg)
            look = decide(plan.designs[t], plan.design_look(t, k), c.score_lost, c.score_gained, c.n, margin, c.design_effect)
            verdicts.append(judge_task(c, replace(cfg, alpha=cap_alpha(cfg, plan.designs[t], plan.design_look(t, k))),
                                       min(1.0, test.p_inferior * family), test, by_task.get(t, []), floors.get(t),
                                       look=look))
        statuses = {v.status for v in verdicts}
        status = FAIL if FAIL in statuses else PASS if statuses == {PASS} else INCONCLUSIVE if k == last else CONTINUE
        if status in (PASS, FAIL):
            break
    items = plan.counts(k)
    record = {
        "decision": status, "look": k + 1, "looks": plan.looks, "items": items, "items_total": sum(items.values()),
        "max_items": {t: len(ids) for t, ids in plan.order.items()},
        "boundary": {v.task: v.look.boundary for v in verdicts},
        "alpha_pass": cfg.alpha, "alpha_fail": alpha_fail, "interval_level": level,
        "design": {"looks": cfg.sequential.to_dict()["looks"], "pass_spending": cfg.sequential.pass_spending.name,
                   "fail_spending": cfg.sequential.fail_spending.name,
                   "tasks": {t: d.to_dict() for t, d in plan.designs.items()}},
    }
    return status, verdicts, rc, record


# ----------------------------------------------------------------------------- evaluating


def _config_object(config: GateConfig | None) -> GateConfig:
    """The gate's rules as parsed at the edge (:func:`kveval.gate.config.load_gate_config`); ``None``: the defaults.
    A path or mapping here is a caller's bug: the config is read once, not again below the edge."""
    if config is None:
        return GateConfig()
    if not isinstance(config, GateConfig):
        raise TypeError(f"the gate takes a GateConfig, not {type(config).__name__}; read it once with load_gate_config")
    return config


def evaluate_gate(
    config: GateConfig | None,
    baseline_dir: str | os.PathLike,
    candidate_dirs: Sequence[str | os.PathLike],
    *,
    metric: str | dict[str, str] | None = None,
    known_tasks: Sequence[str] | None = None,
    noise_floor: str | os.PathLike | None = None,
    family: int | None = None,
) -> GateResult:
    """Evaluate candidates against a baseline (a run folder, or a loaded :class:`~kveval.runs.results.Run`) under
    the gate rules.

    A candidate whose results cannot be read or paired gets status ``"ERROR"``
    (the others are still judged). Raises :class:`ResultFileError` for a bad
    baseline or a gated task missing from it, :class:`UsageError` for no
    candidates, :class:`~kveval.errors.ConfigError` for a bad config, or one whose per-task settings name a task
    not among ``known_tasks`` (default: the baseline's tasks; a sweep's: every model's).
    ``noise_floor``: a second run of the baseline in another batch arrangement (:func:`noise_floors`).

    Under a sequential config (``cfg.sequential``) each candidate is judged look by look (:func:`judge_sequential`)
    and may hold only the first blocks of the baseline's items; ``family``: how many FAIL tests share ``alpha``
    (default :func:`kveval.gate.sequential.family_size` of these candidates; a sweep judging a model's candidates
    one by one gives the family of all of them).
    """
    cfg = _config_object(config)
    if not candidate_dirs:
        raise UsageError("no candidate runs to gate")
    base = load_run(baseline_dir, metric=metric)
    base_tasks = list(dict.fromkeys(it.task for it in base.items))
    cfg.check_tasks(base_tasks if known_tasks is None else known_tasks)
    if cfg.tasks == "all":
        gated = base_tasks
    else:
        missing = [t for t in cfg.tasks if t not in base_tasks]
        if missing:
            raise ResultFileError(
                f"gated task(s) {', '.join(missing)} not in the baseline results {base.path} (it has {', '.join(base_tasks)})"
            )
        gated = list(cfg.tasks)
    if cfg.sequential is not None:
        return _evaluate_sequential(cfg, base, gated, candidate_dirs, metric, noise_floor, family)
    verdicts: list[CandidateVerdict] = []
    base_digest = run_digest(base)
    for cand in candidate_dirs:
        judged = {"baseline": base_digest, "candidate": None}
        try:
            cand_run = _candidate_run(base, cand, metric, judged)
            rc = compare_runs(
                base, cand_run, confidence_level=cfg.confidence_level, n_resamples=cfg.n_resamples, seed=cfg.seed,
                cells=False, metric=metric,
            )
        except (ResultFileError, ValueError, OSError) as exc:
            verdicts.append(CandidateVerdict(str(cand), str(cand), ERROR, error=str(exc), judged=judged))
            continue
        verdicts.append(
            CandidateVerdict(str(cand), rc.candidate.name, PASS, info=rc.candidate, comparison=rc,
                             warnings=pairing_warnings(base, cand_run), judged=judged)
        )
    floors = noise_floors(base, load_run(noise_floor, metric=metric)) if noise_floor is not None else {}
    result = GateResult(cfg, base.info, str(base.path), gated, verdicts, noise_floor=floors,
                        noise_floor_path=str(noise_floor) if noise_floor is not None else None)
    _judge_all([result], cfg)
    return result


def _candidate_run(base, cand, metric, judged: dict[str, Any]):
    """Load the candidate ``cand`` (its digest into ``judged``), refusing the baseline itself as a candidate."""
    cand_run = load_run(cand, metric=metric)
    judged["candidate"] = run_digest(cand_run)
    if is_same_run(base, cand_run):
        raise ResultFileError(f"{cand_run.path} is the baseline {base.path} again (the same policy, answers and "
                              f"scores): a baseline gated against itself shows nothing; give a compressed run as "
                              f"the candidate")
    return cand_run


def _evaluate_sequential(cfg: GateConfig, base, gated: list[str], candidate_dirs, metric, noise_floor,
                         family: int | None) -> GateResult:
    """:func:`evaluate_gate` under a sequential config: every candidate judged by :func:`judge_sequential`."""
    family = family or seq.family_size(cfg, len(gated), len(candidate_dirs))
    floor = load_run(noise_floor, metric=metric) if noise_floor is not None else None
    if floor is not None:  # refused before any candidate is judged on it
        check_noise_floor_run(floor)
    verdicts: list[CandidateVerdict] = []
    base_digest = run_digest(base)
    for cand in candidate_dirs:
        judged = {"baseline": base_digest, "candidate": None}
        try:
            cand_run = _candidate_run(base, cand, metric, judged)
            status, tasks, rc, record = judge_sequential(cfg, base, cand_run, gated, family, floor)
        except (ResultFileError, ValueError, OSError) as exc:
            verdicts.append(CandidateVerdict(str(cand), str(cand), ERROR, error=str(exc), judged=judged))
            continue
        verdict = CandidateVerdict(str(cand), rc.candidate.name, INCONCLUSIVE if status == CONTINUE else status,
                                   tasks, info=rc.candidate, comparison=rc,
                                   warnings=pairing_warnings(base, cand_run), judged=judged, sequential=record)
        verdicts.append(verdict)
    floors = noise_floors(seq.subset(base, {r.id for r in floor.items}), floor) if floor is not None else {}
    return GateResult(cfg, base.info, str(base.path), gated, verdicts, noise_floor=floors,
                      noise_floor_path=str(noise_floor) if noise_floor is not None else None)


def check_noise_floor_run(rerun) -> None:
    """Refuse a noise-floor run that is not an uncompressed (baseline) run (:class:`ResultFileError`)."""
    if not rerun.info.is_baseline:
        raise ResultFileError(f"noise floor {rerun.path}: runs policy {rerun.info.policy}, not the baseline none")


def noise_floors(base, rerun) -> dict[str, NoiseFloor]:
    """Per task, how the baseline ``base`` differs from ``rerun``, the same baseline run again in another batch
    arrangement: the flips any candidate makes without compressing anything. Refuses a rerun that is not the same
    model's uncompressed run on the same items (:class:`ResultFileError`)."""
    check_noise_floor_run(rerun)
    pairs = pair_runs(base, rerun)
    out: dict[str, NoiseFloor] = {}
    for task in dict.fromkeys(b.task for b, _ in pairs):
        these = [(b, r) for b, r in pairs if b.task == task]
        out[task] = NoiseFloor(task, len(these), sum(b.correct != r.correct for b, r in these),
                               sum(b.answer != r.answer for b, r in these))
    return out


def group_runs_by_baseline(run_dirs: Sequence[str | os.PathLike]) -> list[tuple[Path, list[Path]]]:
    """Pair each compressed run of a sweep with its model's baseline run (one entry per model).

    Raises :class:`ResultFileError` for an unreadable run, a model with
    candidates but no baseline, or a model with two baselines.
    """
    groups: dict[str, dict[str, Any]] = {}
    for path in expand_run_dirs(run_dirs):
        info = load_run(path).info
        g = groups.setdefault(info.model, {"baseline": None, "candidates": []})
        if info.is_baseline:
            if g["baseline"] is not None:
                raise ResultFileError(f"two baseline runs for model {info.model!r}: {g['baseline']} and {path}")
            g["baseline"] = path
        else:
            g["candidates"].append(path)
    out = []
    for model, g in groups.items():
        if g["baseline"] is None:
            raise ResultFileError(
                f"no baseline run (policy none) for model {model!r}; its {len(g['candidates'])} run(s) cannot be gated "
                f"({', '.join(str(c) for c in g['candidates'][:3])})"
            )
        if g["candidates"]:
            out.append((g["baseline"], g["candidates"]))
    return out


def evaluate_sweep(
    config: GateConfig | None,
    run_dirs: Sequence[str | os.PathLike],
    *,
    metric: str | dict[str, str] | None = None,
    noise_floors: Mapping[str, Path] | None = None,
) -> list[GateResult]:
    """Gate every compressed run of a sweep against its own model's baseline (one :class:`GateResult` per model).

    ``noise_floors``: baseline run folder (as a string) -> that baseline run again in another batch arrangement.
    """
    cfg = _config_object(config)
    floors = {str(Path(k)): v for k, v in (noise_floors or {}).items()}
    groups = [(base, load_run(base, metric=metric), cands) for base, cands in group_runs_by_baseline(run_dirs)]
    known = list(dict.fromkeys(it.task for _, run, _ in groups for it in run.items))
    results = [evaluate_gate(cfg, run, cands, metric=metric, known_tasks=known, noise_floor=floors.get(str(Path(base))))
               for base, run, cands in groups]
    if cfg.family == "sweep" and len(results) > 1 and cfg.sequential is None:  # sequential: per model's family
        _judge_all(results, cfg)
    return results
