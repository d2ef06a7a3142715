"""The leaderboard's PNG plots (:mod:`kveval.report.leaderboard`): score and KL against compression, change against the
baseline over context length x depth, and memory-confusion categories per policy. Matplotlib's Agg canvas only:
no pyplot, no global backend switch. Each function returns the path it wrote, or ``None`` when its rows hold
nothing to plot."""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np

from kveval.report.rows import Row
from kveval.stats.comparison import CATEGORIES, OVERALL, confusion_rates


def _figure(width: float, height: float):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(width, height), dpi=100)
    FigureCanvasAgg(fig)  # Agg canvas, no pyplot and no global backend switch
    return fig


def _save(fig, path: Path) -> Path:
    fig.savefig(path, format="png", bbox_inches="tight", metadata={"Software": None})
    return path


def slug(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", s).strip("_") or "model"


def by_model(rows: list[Row]) -> dict[str, list[Row]]:
    out: dict[str, list[Row]] = {}
    for r in rows:
        out.setdefault(r.info.model, []).append(r)
    return out


def family_label(rows: list[Row]) -> str:
    """A legend entry for one line of runs: every run's full policy spec (``random(ratio=0.5)``, never the bare
    family name ``random``), in the line's order."""
    return ", ".join(dict.fromkeys(r.label for r in rows))


def _family(r: Row) -> str:
    return r.info.family + ("" if r.info.mode == "context" else f" [{r.info.mode}]")


#: Where :func:`place_legend` tries a legend inside the axes, in order, before it puts it outside them.
LEGEND_PLACES = ("lower left", "upper right", "lower right", "upper left", "center left", "center right",
                 "lower center", "upper center", "center")


def _marker_points(ax) -> list[tuple[float, float, float]]:
    """Every marker ``ax`` draws, as ``(x, y, radius)`` in display pixels (lines without markers draw no point)."""
    ax.get_xlim(), ax.get_ylim()  # the view limits autoscaling gives (computed lazily): transData maps through them
    points = []
    for line in ax.lines:
        if line.get_marker() in (None, "", "None", " ") or not line.get_visible():
            continue
        radius = line.get_markersize() / 2 * ax.figure.dpi / 72 + line.get_markeredgewidth() * ax.figure.dpi / 72
        for x, y in ax.transData.transform(line.get_xydata()):
            points.append((float(x), float(y), radius))
    return points


def covered_points(ax, legend) -> list[tuple[float, float]]:
    """The markers of ``ax`` (:func:`_marker_points`) that ``legend``'s box overlaps, in display pixels."""
    box = legend.get_window_extent(ax.figure.canvas.get_renderer())
    return [(x, y) for x, y, r in _marker_points(ax)
            if box.x0 - r < x < box.x1 + r and box.y0 - r < y < box.y1 + r]


def place_legend(ax, **kwargs):
    """A legend on ``ax`` that covers no marker: the first of :data:`LEGEND_PLACES` whose box overlaps none (by the
    renderer's boxes, after the figure's layout is final), else outside the axes, to their right."""
    for loc in LEGEND_PLACES:
        legend = ax.legend(loc=loc, **kwargs)
        if not covered_points(ax, legend):
            return legend
    return ax.legend(loc="upper left", bbox_to_anchor=(1.02, 1.0), borderaxespad=0.0, **kwargs)


def score_vs_compression_figure(rows: list[Row]):
    """The figure of :func:`plot_score_vs_compression`, laid out, its legends placed (for tests to measure)."""
    models = by_model(rows)
    n = len(models)
    cols = min(n, 3)
    nrows = math.ceil(n / cols)
    fig = _figure(5.2 * cols, 3.8 * nrows)
    for k, (model, group) in enumerate(models.items()):
        ax = fig.add_subplot(nrows, cols, k + 1)
        families: dict[str, list[tuple[float, float, bool, Row]]] = {}
        for r in group:
            if r.info.is_baseline:
                ax.axhline(r.score, linestyle="--", color="0.3", label=f"baseline ({r.score:.2f})")
                ax.plot([r.info.compression or 1.0], [r.score], marker="*", markersize=10, color="0.3", linestyle="none")
                continue
            x, measured = r.info.compression, True
            if x is None and r.info.ratio is not None and r.info.ratio < 1:
                x, measured = 1.0 / (1.0 - r.info.ratio), False
            if x is None:
                continue
            families.setdefault(_family(r), []).append((x, r.score, measured, r))
        for fam, pts in sorted(families.items()):
            pts.sort(key=lambda p: p[:3])
            line = ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=family_label([p[3] for p in pts]))[0]
            hollow = [p for p in pts if not p[2]]
            if hollow:
                ax.plot([p[0] for p in hollow], [p[1] for p in hollow], "o", mfc="white", mec=line.get_color())
        ax.set_xlabel("compression factor (uncompressed / measured cache bytes; hollow: nominal)")
        ax.set_ylabel("score (all items)")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(model)
        ax.grid(alpha=0.3)
    fig.tight_layout()  # the axes' final boxes first: a legend is placed by where the points land
    for ax in fig.axes:
        place_legend(ax, fontsize=7)
    return fig


def plot_score_vs_compression(rows: list[Row], path: Path) -> Path | None:
    """Score (all items) vs compression factor: a line per policy family, the baseline dashed; each model's legend
    where it covers no point (:func:`place_legend`)."""
    return _save(score_vs_compression_figure(rows), path)


def plot_kl_vs_compression(rows: list[Row], path: Path) -> Path | None:
    """Mean KL from the baseline (teacher-forced baseline answers, log scale) vs compression factor, per policy family."""
    measured = [r for r in rows if r.fidelity and r.info.compression]
    if not measured:
        return None
    models = by_model(measured)
    cols = min(len(models), 3)
    fig = _figure(5.2 * cols, 3.8 * math.ceil(len(models) / cols))
    for k, (model, group) in enumerate(models.items()):
        ax = fig.add_subplot(math.ceil(len(models) / cols), cols, k + 1)
        families: dict[str, list[tuple[float, float, Row]]] = {}
        for r in group:
            families.setdefault(_family(r), []).append((r.info.compression, max(r.fidelity["kl_mean"], 1e-8), r))
        for fam, pts in sorted(families.items()):
            pts.sort(key=lambda p: p[:2])
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=family_label([p[2] for p in pts]))
        ax.set_yscale("log")
        ax.set_xlabel("compression factor (uncompressed / measured cache bytes)")
        ax.set_ylabel("mean KL from baseline (nats/token)")
        ax.set_title(model)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return _save(fig, path)


def plot_heatmaps(model: str, group: list[Row], path: Path) -> Path | None:
    """Per policy of one model: mean score change vs baseline over context length x needle depth."""
    panels = []
    for r in group:
        if r.comparison is None:
            continue
        lengths, depths, delta, counts = r.comparison.grid()
        if delta.size:
            panels.append((r, lengths, depths, delta, counts))
    if not panels:
        return None
    cols = min(len(panels), 3)
    nrows = math.ceil(len(panels) / cols)
    fig = _figure(4.6 * cols, 3.6 * nrows)
    image = None
    for k, (r, lengths, depths, delta, counts) in enumerate(panels):
        ax = fig.add_subplot(nrows, cols, k + 1)
        image = ax.imshow(np.ma.masked_invalid(delta), cmap="RdBu", vmin=-1, vmax=1, aspect="auto", origin="lower")
        ax.set_xticks(range(len(depths)), [("-" if d is None else f"{d:g}") for d in depths])
        ax.set_yticks(range(len(lengths)), [("-" if L is None else str(L)) for L in lengths])
        ax.set_xlabel("needle depth")
        if k % cols == 0:
            ax.set_ylabel("context length (tokens)")
        ax.set_title(r.label, fontsize=9)
        for i in range(delta.shape[0]):
            for j in range(delta.shape[1]):
                if counts[i, j]:
                    v = delta[i, j]
                    ax.text(j, i, f"{v:+.2f}", ha="center", va="center", fontsize=7, color="white" if abs(v) > 0.6 else "black")
    fig.subplots_adjust(wspace=0.3, hspace=0.45)
    if image is not None:
        fig.colorbar(image, ax=fig.axes, shrink=0.8, label="score change vs baseline")
    fig.suptitle(f"{model}: change vs baseline")
    return _save(fig, path)


def plot_confusion(model: str, group: list[Row], path: Path) -> Path | None:
    """Stacked bars: share of items per wrong-answer category, per policy of one model; ``None`` (no file, no
    chart) when no run of the model answered an item wrong."""
    data = [(r, confusion_rates(r.run.items)) for r in group]
    data = [(r, c) for r, c in data if c]
    cats = [c for c in CATEGORIES if c != "correct"]
    extra = sorted({k for _, c in data for k in c if k not in CATEGORIES and k != OVERALL})
    cats += extra
    if not any(c.get(cat) for _, c in data for cat in cats):
        return None  # no wrong answer in any run: nothing to stack (an empty chart, and matplotlib's warning)
    fig = _figure(max(5.0, 0.9 * len(data) + 2.5), 4.0)
    ax = fig.add_subplot(1, 1, 1)
    x = np.arange(len(data))
    bottom = np.zeros(len(data))
    colors = {"distractor": "#d62728", "stale": "#ff7f0e", "partial": "#bcbd22", "over_inclusion": "#9467bd",
              "fabricated": "#8c564b", "no_value": "#b0b0b0", "empty": "#7f7f7f"}
    for cat in cats:
        vals = np.array([c.get(cat, 0.0) for _, c in data])
        if not vals.any():
            continue
        ax.bar(x, vals, bottom=bottom, label=cat, color=colors.get(cat))
        bottom += vals
    ax.set_xticks(x, [r.label for r, _ in data], rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("share of items")
    ax.set_ylim(0, max(0.05, float(bottom.max()) * 1.15))
    ax.set_title(f"{model}: wrong answers by category")
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    return _save(fig, path)


def plot_achieved_ratios(model: str, group: list[Row], path: Path) -> Path | None:
    """Each item's achieved ratio (fraction of the cache's bytes removed), one strip per run whose policy reaches a
    ratio per item (``achieved_ratio`` in ``run.json``: threshold methods), a bar at its mean. ``None`` without one."""
    runs = [r for r in group if r.info.achieved_ratio and not r.info.is_baseline]
    if not runs:
        return None
    fig = _figure(max(5.0, 1.1 * len(runs) + 3.0), 3.8)
    ax = fig.add_subplot(1, 1, 1)
    for k, r in enumerate(runs):
        ratios = [it.metrics["achieved_ratio"] for it in r.run.items if it.metrics.get("achieved_ratio") is not None]
        jitter = np.linspace(-0.25, 0.25, len(ratios)) if len(ratios) > 1 else np.zeros(len(ratios))
        ax.scatter(k + jitter, ratios, s=10, alpha=0.6)
        ax.hlines(r.info.achieved_ratio["mean"], k - 0.3, k + 0.3, colors="black", linewidth=1.5)
    ax.set_xticks(np.arange(len(runs)), [r.label for r in runs], rotation=30, ha="right", fontsize=8)
    ax.set_xlim(-0.6, len(runs) - 0.4)
    ax.set_ylabel("ratio reached (cache bytes removed)")
    ax.set_ylim(0, 1)
    ax.set_title(f"{model}: ratio each item reached (bar: mean)")
    fig.tight_layout()
    return _save(fig, path)


__all__ = ["LEGEND_PLACES", "by_model", "covered_points", "family_label", "place_legend", "plot_achieved_ratios", "plot_confusion", "plot_heatmaps", "plot_kl_vs_compression", "plot_score_vs_compression", "score_vs_compression_figure", "slug"]
