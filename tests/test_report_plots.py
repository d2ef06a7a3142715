"""The report's plots on the committed quickstart's runs: the legend covers no point (measured by the renderer's
boxes), a chart with nothing to show is not drawn, and the family filter's table of policy families is the
registry's."""

from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

from kveval.report import plots
from kveval.report.families import FAMILIES, POLICY_FAMILIES, spec_families, spec_terms
from kveval.report.rows import collect_rows
from kveval.runs.records import ItemRecord, ItemWriter, RunInfo, write_run_info

QUICKSTART = Path(__file__).resolve().parent.parent / "results" / "quickstart"


@pytest.fixture(scope="module")
def quickstart_rows():
    rows, _ = collect_rows([QUICKSTART], n_resamples=999)
    return rows


def _points(ax) -> dict[str, list[tuple[float, float, float]]]:
    """Each marker line's points in display pixels with the marker's radius, by the line's label."""
    out = {}
    for k, line in enumerate(ax.lines):
        if line.get_marker() in (None, "", "None", " "):
            continue
        r = (line.get_markersize() / 2 + line.get_markeredgewidth()) * ax.figure.dpi / 72
        out[f"{k}:{line.get_label()}"] = [(x, y, r) for x, y in ax.transData.transform(line.get_xydata())]
    return out


def _overlaps(box, points) -> list[tuple[float, float]]:
    return [(x, y) for x, y, r in points if box.x0 - r < x < box.x1 + r and box.y0 - r < y < box.y1 + r]


def test_the_score_legend_covers_no_point_of_the_quickstart(quickstart_rows):
    fig = plots.score_vs_compression_figure(quickstart_rows)
    renderer = fig.canvas.get_renderer()
    fig.canvas.draw()  # as saved: the boxes of the drawn figure
    ax = fig.axes[0]
    points = _points(ax)
    assert sum(len(p) for p in points.values()) == 4  # the baseline's star and the three policies' points
    box = ax.get_legend().get_window_extent(renderer)
    assert {label: _overlaps(box, p) for label, p in points.items()} == {label: [] for label in points}
    # where the legend sat before ("lower left") it covered random(ratio=0.5)'s point
    old = ax.legend(loc="lower left", fontsize=7).get_window_extent(renderer)
    covered = {label for label, p in points.items() if _overlaps(old, p)}
    assert covered == {next(label for label in points if "random(ratio=0.5)" in label)}


def test_a_legend_that_fits_nowhere_inside_goes_outside(tmp_path):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(3, 2), dpi=100)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(1, 1, 1)
    grid = np.linspace(0, 1, 12)
    xs, ys = np.meshgrid(grid, grid)
    ax.plot(xs.ravel(), ys.ravel(), "o", label="everywhere")
    legend = plots.place_legend(ax, fontsize=7)
    assert plots.covered_points(ax, legend) == []
    assert legend.get_window_extent(fig.canvas.get_renderer()).x0 > ax.get_window_extent().x1


def _run(folder: Path, policy: str, answers: list[tuple[str, str]]) -> Path:
    write_run_info(folder, RunInfo(name=f"tiny/{policy}", model="tiny", policy=policy, family=policy.split("(")[0],
                                   bytes_per_token=100.0, nominal_bytes_per_token=200.0))
    with ItemWriter(folder) as w:
        for k, (answer, category) in enumerate(answers):
            right = category == "correct"
            w.write(ItemRecord(id=f"passkey-{k}", hash=f"h{k}", task="passkey", score=float(right), correct=right,
                               category=category, answer=answer, gold=["1234"]))
    return folder


def test_no_confusion_chart_without_a_wrong_answer(tmp_path, capfd):
    """Every answer right: the confusion chart was an empty frame, and matplotlib warned on stderr."""
    root = tmp_path / "runs"
    _run(root / "none", "none", [(" 1234", "correct")] * 4)
    _run(root / "q", "quant(bits=8)", [(" 1234", "correct")] * 4)
    rows, _ = collect_rows([root / "none", root / "q"], n_resamples=999)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plots.plot_confusion("tiny", rows, tmp_path / "confusion.png") is None
    assert not (tmp_path / "confusion.png").exists()
    assert capfd.readouterr().err == ""
    # one wrong answer: the chart is drawn
    _run(root / "w", "knorm(ratio=0.5)", [(" 1234", "correct")] * 3 + [(" ", "empty")])
    rows, _ = collect_rows([root / "none", root / "q", root / "w"], n_resamples=999)
    assert plots.plot_confusion("tiny", rows, tmp_path / "confusion.png") == tmp_path / "confusion.png"


def test_spec_families():
    assert spec_terms("snapkv(ratio=0.5)+kivi(bits=4)") == ["snapkv", "kivi"]
    assert spec_terms("none") == []
    assert spec_families("lowrank(rank=16)+quant(bits=8,group=16)") == ["structure", "quantization"]
    assert spec_families("threshold(scorer=keydiff,threshold=-0.8)") == ["selection"]
    assert spec_families("myplugin(x=1)+kivi(bits=2)") == ["quantization", "other"]
    assert spec_families("none") == []


def test_the_family_table_is_the_registry():
    """The report cannot import the policies (torch); its table of their families must equal the registry's."""
    from kveval.policies.base import FAMILY_ORDER
    from kveval.policies.registry import BUILTINS, POLICIES

    assert FAMILIES == FAMILY_ORDER
    registered = {name: POLICIES[name].family for name in BUILTINS if name != "none"}
    assert POLICY_FAMILIES == registered
