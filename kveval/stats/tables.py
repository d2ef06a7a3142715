"""A paired comparison as terminal text: p-values, deltas with intervals, the confusion change, the per-task table."""

from __future__ import annotations

import math

from kveval.stats.comparison import OVERALL, Comparison, RunComparison


def fmt_p(p: float | None) -> str:
    if p is None or (isinstance(p, float) and math.isnan(p)):
        return "-"
    if p < 0.0001:
        return f"{p:.1e}"
    return f"{p:.4f}" if p < 0.01 else f"{p:.3f}"


def fmt_delta_ci(c: Comparison, digits: int = 2) -> str:
    return f"{c.delta:+.{digits}f} [{c.ci_low:+.{digits}f},{c.ci_high:+.{digits}f}]"


def top_confusion_change(c: Comparison, k: int = 2) -> str:
    changes = [(cat, d) for cat, d in c.confusion_delta.items() if cat not in ("correct", OVERALL) and abs(d) > 1e-12]
    changes.sort(key=lambda kv: -abs(kv[1]))
    return ", ".join(f"{cat} {d * 100:+.0f}pt" for cat, d in changes[:k]) or "-"


def format_table(rc: RunComparison) -> str:
    """Readable terminal table of a :class:`RunComparison`."""
    head = (
        f"baseline:  {rc.baseline.name} ({rc.baseline_path})\n"
        f"candidate: {rc.candidate.name} ({rc.candidate_path})\n"
        f"{rc.n} paired items ({rc.source} results); delta = candidate - baseline, "
        f"{int(round(rc.overall.confidence_level * 100))}% CI (Tango score interval of the mean score change; paired bootstrap for mostly graded tasks); "
        f"Holm/BH across {len(rc.tasks)} task(s)\n"
    )
    cols = ["task", "n", "base", "cand", "delta [CI]", "test", "p", "Holm", "BH", "-flip", "+flip", "agree", "confusion change"]
    rows = []
    for c in [*rc.tasks, rc.overall]:
        rows.append(
            [
                c.cell,
                str(c.n),
                f"{c.baseline_score:.3f}",
                f"{c.candidate_score:.3f}",
                fmt_delta_ci(c),
                c.test,
                fmt_p(c.pvalue),
                fmt_p(c.p_holm) if c is not rc.overall else "",
                fmt_p(c.p_bh) if c is not rc.overall else "",
                f"{c.negative_flip_rate * 100:.1f}%",
                f"{c.positive_flip_rate * 100:.1f}%",
                f"{c.agreement * 100:.0f}%",
                top_confusion_change(c),
            ]
        )
    if any(c.fidelity for c in [*rc.tasks, rc.overall]):  # runs made with --fidelity: the teacher-forced columns
        cols += ["KL", "top-1"]
        for row, c in zip(rows, [*rc.tasks, rc.overall]):
            row += [f"{c.fidelity['kl_mean']:.3g}", f"{c.fidelity['top1_agreement'] * 100:.1f}%"] if c.fidelity else ["-", "-"]
    widths = [max(len(r[i]) for r in [cols, *rows]) for i in range(len(cols))]
    lines = ["  ".join(v.ljust(w) if i in (0, 4, 5, 12) else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths))) for r in [cols, *rows]]
    lines.insert(1, "  ".join("-" * w for w in widths))
    out = head + "\n" + "\n".join(lines)
    lp = [c for c in rc.tasks if c.logprob_delta is not None]
    if lp:
        out += "\n\ngold log-probability change (mean, CI): " + "; ".join(
            f"{c.task} {c.logprob_delta:+.3f} [{c.logprob_ci_low:+.3f},{c.logprob_ci_high:+.3f}] (n={c.n_logprob})" for c in lp
        )
    fid = [c for c in rc.tasks if c.fidelity]
    if fid:
        out += ("\n\nfidelity, the baseline's answer teacher-forced (KL in nats: mean per item [one-sided upper bound], "
                "largest per token; top-1 agreement; answer log-prob change): " + "; ".join(
                    f"{c.task} KL {f['kl_mean']:.3g} [{f['kl_mean_upper']:.3g}] max {f['kl_max_item']:.3g}, "
                    f"top-1 {f['top1_agreement'] * 100:.1f}%, logp {f['answer_logprob_delta']:+.3f} (n={f['n']})"
                    for c in fid for f in [c.fidelity]))
    reg = [r for c in rc.tasks for r in c.regressed]
    if reg:
        shown = ", ".join(f"{r['id']} ({r.get('recalled') or r['category'] or 'wrong'})" for r in reg[:8])
        out += f"\n\nregressed items ({len(reg)}): {shown}" + (", ..." if len(reg) > 8 else "")
    return out


# ----------------------------------------------------------------------------- CLI


