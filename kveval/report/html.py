"""The leaderboard as one self-contained HTML page (``leaderboard.html``): it opens offline, from a file, with no
server and nothing fetched (inline CSS, a little inline JavaScript written here, PNGs as base64).

The page, top to bottom:

- the verdicts, one sentence per compressed run (:mod:`kveval.report.verdicts`), the gate's statistical reasons
  folded under each (``<details>``), each linking to the run's items;
- filters (model; task; family: selection, structure or quantization, the baseline shown under each; policy: one
  full spec; verdict) and the leaderboard table, verdict first; a click on a column header sorts by it (again: the
  other way); every cell of a compared run links to its items (a task's cell to that task's);
- the PNG plots (:mod:`kveval.report.plots`): one score-vs-compression plot, the heatmaps, the confusion bars;
- the per-item before/after views (:mod:`kveval.report.items`), one section per compressed run, shown when a link
  points into it (``#items-<run>`` or ``#items-<run>--<task>``): regressed and improved items, then items wrong in
  both runs that changed category.

Filtering to a task hides the other tasks' columns and items, and turns the pooled columns (all items, change [CI],
-flips, confusion) into that task's: each such cell holds one ``<span data-scope>`` per task beside the pooled one
(``data-scope=""``), and the filter shows the one it names. The page works without JavaScript except for sorting,
filtering and showing one run's items at a time (without it every item section shows, and the pooled values).
"""

from __future__ import annotations

import base64
import html
import json
import math
import re
from pathlib import Path
from typing import Mapping, Sequence

from kveval.report.families import FAMILIES, OTHER, spec_families
from kveval.report.items import KINDS, Answer, ItemChange, RunChanges
from kveval.report.rows import (
    DECODE_HEADER,
    MODES_HEADER,
    Row,
    decode_cells,
    fmt,
    modes_table,
    part_bytes,
    part_bytes_text,
    shows_decode,
)
from kveval.report.verdicts import Verdict, verdict

STAR = "\u2605"
e = html.escape

_CSS = """
body{font-family:-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em;color:#222;max-width:1400px}
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:1.6em}h3{font-size:1.05em}h4{font-size:0.95em;margin:0 0 .4em}
a{color:#0b57d0;text-decoration:none}a:hover{text-decoration:underline}
table{border-collapse:collapse;font-size:0.85em}
th,td{border:1px solid #ccc;padding:4px 8px;text-align:right;white-space:nowrap}
th{background:#f0f0f0;cursor:pointer;user-select:none}th[aria-sort=ascending]::after{content:" \\25B2"}
th[aria-sort=descending]::after{content:" \\25BC"}td.l{text-align:left}
td.best{font-weight:bold;background:#eef7ee}
.PASS{color:#1a7f37;font-weight:bold}.FAIL{color:#c62828;font-weight:bold}.ERROR{color:#c62828}
.INCONCLUSIVE{color:#b26a00;font-weight:bold}
p.note{font-size:0.85em;color:#555;max-width:1000px}
img{max-width:100%;border:1px solid #eee;margin:0.5em 0}
div.verdict{margin:.5em 0;max-width:1100px}div.verdict details{font-size:.85em;color:#444;margin-left:1em}
div.verdict li{font-family:monospace;font-size:.95em}
ul.gate li{font-family:monospace;font-size:0.85em}
form.filters{margin:1em 0;font-size:.9em}form.filters label{margin-right:1.2em}
.hidden{display:none!important}div.wide{overflow-x:auto}
section.items{border-top:2px solid #ccc;margin-top:2em}
article.item{border:1px solid #ddd;border-left:4px solid #999;padding:.6em .9em;margin:.8em 0;max-width:1200px}
article.regressed{border-left-color:#c62828}article.improved{border-left-color:#1a7f37}article.changed{border-left-color:#b26a00}
h4 span.meta{font-weight:normal;color:#666;margin-left:.6em}
blockquote.ctx{font-family:Georgia,serif;font-size:.85em;background:#fafafa;margin:.4em 0;padding:.5em .8em;white-space:pre-wrap}
mark{background:#ffe066;padding:0 .1em}
table.answers{width:100%;table-layout:fixed;margin:.4em 0}table.answers td,table.answers th{white-space:normal;text-align:left;vertical-align:top}
pre.answer,pre.doc{white-space:pre-wrap;margin:0;font-size:.95em}pre.doc{max-height:16em;overflow:auto;background:#fafafa;padding:.4em}
span.cat{display:inline-block;margin-top:.3em;font-size:.85em;padding:0 .4em;border-radius:3px;background:#eee}
span.cat.correct{background:#dff3e3}span.cat.wrong{background:#fde2e1}
p.kept,p.q{font-size:.85em;margin:.3em 0}p.kept{color:#555}
"""

_JS = r"""
(function(){
  var table = document.getElementById('leaderboard');
  function val(td){ var src = td.querySelector('[data-scope]:not(.hidden)') || td;
    var v = src.getAttribute('data-v'); var n = parseFloat(v);
    return (v !== null && v !== '' && !isNaN(n) && isFinite(v)) ? n : (v === null ? src.textContent : v); }
  table.querySelectorAll('th').forEach(function(th, col){
    th.addEventListener('click', function(){
      var asc = th.getAttribute('aria-sort') !== 'ascending';
      table.querySelectorAll('th').forEach(function(h){ h.removeAttribute('aria-sort'); });
      th.setAttribute('aria-sort', asc ? 'ascending' : 'descending');
      var body = table.tBodies[0], rows = Array.prototype.slice.call(body.rows);
      rows.sort(function(a, b){
        var x = val(a.cells[col]), y = val(b.cells[col]);
        if (typeof x === 'number' && typeof y === 'number') return asc ? x - y : y - x;
        if (typeof x === 'number') return -1; if (typeof y === 'number') return 1;
        return asc ? String(x).localeCompare(String(y)) : String(y).localeCompare(String(x));
      });
      rows.forEach(function(r){ body.appendChild(r); });
    });
  });
  var filters = ['model', 'task', 'family', 'policy', 'verdict'];
  function apply(){
    var want = {};
    filters.forEach(function(f){ want[f] = document.getElementById('f-' + f).value; });
    document.querySelectorAll('[data-row]').forEach(function(el){
      var show = ['model', 'policy', 'verdict'].every(function(f){ return !want[f] || el.getAttribute('data-' + f) === want[f]; });
      var families = el.getAttribute('data-families').split(' ');
      show = show && (!want.family || el.hasAttribute('data-baseline') || families.indexOf(want.family) >= 0);
      el.classList.toggle('hidden', !show);
    });
    document.querySelectorAll('[data-task]').forEach(function(el){
      el.classList.toggle('hidden', !!want.task && el.getAttribute('data-task') !== want.task);
    });
    document.querySelectorAll('[data-scope]').forEach(function(el){
      el.classList.toggle('hidden', el.getAttribute('data-scope') !== want.task);
    });
  }
  filters.forEach(function(f){ document.getElementById('f-' + f).addEventListener('change', apply); });
  function route(){
    var id = decodeURIComponent(location.hash.slice(1)), target = id && document.getElementById(id);
    var section = target && target.closest ? target.closest('section.items') : null;
    document.querySelectorAll('section.items').forEach(function(s){ s.classList.toggle('hidden', s !== section); });
    if (section) { target.scrollIntoView(); }
  }
  window.addEventListener('hashchange', route);
  route();
})();
"""


def anchors(rows: Sequence[Row]) -> dict[str, str]:
    """A unique HTML id per row (by run name): its name with every run of characters other than letters, digits,
    ``.``, ``_`` and ``-`` replaced by ``_``, numbered where two would clash."""
    out: dict[str, str] = {}
    for r in rows:
        base = re.sub(r"[^A-Za-z0-9._-]+", "_", r.info.name).strip("_") or "run"
        name, k = base, 2
        while name in out.values():
            name, k = f"{base}-{k}", k + 1
        out[r.info.name] = name
    return out


def task_anchor(run: str, task: str) -> str:
    return f"items-{run}--{re.sub(r'[^A-Za-z0-9._-]+', '_', task)}"


# ----------------------------------------------------------------------------- the table


def _cell(text: str, *, value=None, classes: Sequence[str] = (), href: str | None = None, task: str | None = None,
          best: bool = False) -> str:
    cls = list(classes) + (["best"] if best else [])
    attrs = f' class="{" ".join(cls)}"' if cls else ""
    if value is not None and not (isinstance(value, float) and math.isnan(value)):
        attrs += f' data-v="{e(str(value))}"'
    if task is not None:
        attrs += f' data-task="{e(task)}"'
    inner = e(text) + (f" {STAR}" if best else "")
    if href:
        inner = f'<a href="#{e(href)}">{inner}</a>'
    return f"<td{attrs}>{inner}</td>"


def _scoped(scopes: Sequence[tuple[str, str, object, bool]], *, href: str | None = None) -> str:
    """A cell that holds one value per scope, ``(scope, text, value, best)``: ``""`` (every task pooled, shown) first,
    then one per task (hidden until the task filter names it, :data:`_JS`). Its ``data-v`` is the pooled value, for
    sorting without JavaScript; with it, sorting reads the shown span's."""
    spans = []
    for scope, text, value, best in scopes:
        attrs = f' data-scope="{e(scope)}"' + ("" if scope == "" else ' class="hidden"')
        if value is not None and not (isinstance(value, float) and math.isnan(value)):
            attrs += f' data-v="{e(str(value))}"'
        spans.append(f"<span{attrs}>{e(text)}{f' {STAR}' if best else ''}</span>")
    inner = "".join(spans)
    if href:
        inner = f'<a href="#{e(href)}">{inner}</a>'
    pooled = scopes[0][2]
    missing = pooled is None or (isinstance(pooled, float) and math.isnan(pooled))
    attrs = "" if missing else f' data-v="{e(str(pooled))}"'
    return f"<td{attrs}>{inner}</td>"


def _pooled_cells(r: Row, tasks: Sequence[str], link: str | None) -> list[str]:
    """The all-items, change [CI], -flips and confusion cells of ``r``: pooled over every task, and each task's own
    (:func:`_scoped`)."""
    def change(c) -> tuple[str, object]:
        if c is None:
            return ("baseline", 0.0) if r.info.is_baseline else ("no baseline" if r.comparison is None else "-", None)
        return f"{c.delta:+.3f} [{c.ci_low:+.3f}, {c.ci_high:+.3f}]", c.delta

    def flips(c) -> tuple[str, object]:
        return ("-", None) if c is None else (f"{c.negative_flip_rate * 100:.1f}%", c.negative_flip_rate)

    def of_task(t: str):
        return r.comparison.task(t) if r.comparison is not None and t in r.comparison.task_names else None

    overall = r.comparison.overall if r.comparison is not None else None
    score = [("", fmt(r.score), r.score, "score" in r.best)]
    score += [(t, fmt(r.task_scores.get(t)), r.task_scores.get(t), f"score:{t}" in r.best) for t in tasks]
    delta = [("", *change(overall), "delta" in r.best)]
    delta += [(t, *change(of_task(t)), f"delta:{t}" in r.best) for t in tasks]
    flip = [("", *flips(overall), "flips" in r.best)] + [(t, *flips(of_task(t)), f"flips:{t}" in r.best) for t in tasks]
    conf = [("", fmt(r.confusion_rate, "{:.1%}"), r.confusion_rate, "confusion" in r.best)]
    conf += [(t, fmt(r.task_confusion.get(t), "{:.1%}"), r.task_confusion.get(t), f"confusion:{t}" in r.best)
             for t in tasks]
    compared = link if r.comparison is not None else None
    return [_scoped(score, href=link), _scoped(delta, href=compared), _scoped(flip, href=compared),
            _scoped(conf, href=link)]


def _table(rows: Sequence[Row], tasks: Sequence[str], verdicts: Mapping[str, Verdict], ids: Mapping[str, str],
           with_kl: bool) -> list[str]:
    head = [("verdict", None), ("model", None), ("policy", None), ("ratio", None), ("bytes/token", None),
            ("compression", None)]
    with_parts = any(part_bytes(r) for r in rows)  # DeepSeek V3.2/V4: their caches' parts, measured apart
    if with_parts:
        head.insert(5, ("bytes/token by part", None))
    with_decode = shows_decode(rows)
    if with_decode:
        head += [(h, None) for h in DECODE_HEADER]
    head += [(t, t) for t in tasks]
    every = "<span data-scope=\"\">all items</span>" + "".join(
        f'<span data-scope="{e(t)}" class="hidden">{e(t)} items</span>' for t in tasks)
    head += [(every, ""), ("change [CI]", None), ("-flips", None), ("confusion", None)]
    if with_kl:
        head.append(("KL", None))
    ths = "".join((f'<th data-task="{e(t)}">' if t else "<th>") + (h if t == "" else e(h)) + "</th>" for h, t in head)
    out = [f'<div class="wide"><table id="leaderboard"><thead><tr>{ths}</tr></thead><tbody>']
    for r in rows:
        i, v, run = r.info, verdicts[r.info.name], ids[r.info.name]
        link = None if r.comparison is None else f"items-{run}"
        cells = [
            _cell(v.status, value=v.status, classes=["l", v.status], href=link),
            _cell(i.model, classes=["l"], href=link),
            _cell(r.label, classes=["l"], href=link),
            _cell(i.ratio_text, value=i.ratio if i.ratio is not None else i.achieved_ratio.get("mean"),
                  href=link),
            _cell(fmt(i.bytes_per_token, "{:,.0f}"), value=i.bytes_per_token, href=link),
            _cell(fmt(i.compression, "{:.2f}x"), value=i.compression, best="compression" in r.best, href=link),
        ]
        if with_parts:
            cells.insert(5, _cell(part_bytes_text(r), classes=["l"], href=link))
        if with_decode:
            cells += [_cell(text, value=value, href=link) for text, value in decode_cells(r)]
        for t in tasks:
            s = r.task_scores.get(t)
            text = fmt(s)
            if r.comparison is not None and s is not None and t in r.comparison.task_names:
                text += f" ({r.comparison.task(t).delta:+.2f})"
            cells.append(_cell(text, value=s, task=t, best=f"score:{t}" in r.best,
                               href=task_anchor(run, t) if link and s is not None else None))
        cells += _pooled_cells(r, tasks, link)
        if with_kl:
            kl = r.fidelity["kl_mean"] if r.fidelity else (0.0 if i.is_baseline else None)
            cells.append(_cell("-" if kl is None else f"{kl:.3g}", value=kl, best="kl" in r.best, href=link))
        out.append(f'<tr id="row-{e(run)}" {_row_attrs(r, v)}>' + "".join(cells) + "</tr>")
    out.append("</tbody></table></div>")
    return out


def _row_attrs(r: Row, v: Verdict) -> str:
    """What the filters read of a run's elements: its model, families (space-separated, :func:`spec_families`),
    full policy spec (its label) and verdict; ``data-baseline`` on the baseline, which every family filter shows."""
    return (f'data-row="" data-model="{e(r.info.model)}" data-families="{e(" ".join(spec_families(r.info.policy)))}" '
            f'data-policy="{e(r.label)}" data-verdict="{e(v.status)}"'
            + (' data-baseline=""' if r.info.is_baseline else ""))


def _filters(rows: Sequence[Row], tasks: Sequence[str], verdicts: Mapping[str, Verdict]) -> str:
    families = {f for r in rows for f in spec_families(r.info.policy)}
    choices = {
        "model": sorted({r.info.model for r in rows}),
        "task": list(tasks),
        "family": [f for f in (*FAMILIES, OTHER) if f in families],
        "policy": list(dict.fromkeys(r.label for r in rows)),
        "verdict": sorted({v.status for v in verdicts.values()}),
    }
    out = ['<form class="filters" onsubmit="return false">']
    for name, values in choices.items():
        opts = '<option value="">all</option>' + "".join(f'<option value="{e(v)}">{e(v)}</option>' for v in values)
        out.append(f'<label>{name} <select id="f-{name}">{opts}</select></label>')
    out.append("</form>")
    return "".join(out)


# ----------------------------------------------------------------------------- verdicts and scatter


def _verdicts(rows: Sequence[Row], verdicts: Mapping[str, Verdict], ids: Mapping[str, str]) -> list[str]:
    out = ["<h2>Verdicts</h2>"]
    for r in rows:
        if r.info.is_baseline:
            continue
        v = verdicts[r.info.name]
        sentence = f'<a class="{e(v.status)}" href="#items-{e(ids[r.info.name])}">{e(v.sentence)}</a>' \
            if r.comparison is not None else e(v.sentence)
        detail = ""
        if v.reasons:
            detail = ("<details><summary>statistical detail</summary><ul>"
                      + "".join(f"<li>{e(x)}</li>" for x in v.reasons) + "</ul></details>")
        out.append(f'<div class="verdict" {_row_attrs(r, v)}><b>{e(r.info.model)} \u00b7 {e(r.label)}</b>: '
                   f"{sentence}{detail}</div>")
    return out


# ----------------------------------------------------------------------------- item views


def _answer_cell(side: str, a: Answer) -> str:
    ok = "correct" if a.correct else "wrong"
    recalled = "".join(f"<li>{e(x.describe())}</li>" for x in a.recalled)
    return (f'<td class="{side}"><pre class="answer {side}">{e(a.text)}</pre>'
            f'<span class="cat {ok}">{e(a.category or ok)} \u00b7 score {a.score:.2f}</span>'
            + (f"<ul>{recalled}</ul>" if recalled else "") + "</td>")


def _document(c: ItemChange) -> str:
    d = c.document
    if d is None:
        return ""
    out = [f'<details class="doc"><summary>document</summary><pre class="doc">'
           f"{e(json.dumps(d.doc, indent=1, ensure_ascii=False))}</pre></details>",
           f'<p class="q"><b>Prompt</b></p><pre class="doc prompt">{e(d.prompt)}</pre>']
    if d.choices:
        items = []
        for k, choice in enumerate(d.choices):
            who = [n for n, a in (("baseline", c.baseline), ("candidate", c.candidate)) if a.text == str(k)]
            tag = f" \u2190 {' and '.join(who)}" if who else ""
            items.append(f"<li value=\"{k}\"><code>{e(choice)}</code>{e(tag)}</li>")
        out.append(f'<p class="q"><b>Choices</b> (target {e(d.target)})</p><ol start="0">{"".join(items)}</ol>')
    return "".join(out)


def _item(c: ItemChange, run: str) -> str:
    meta = [c.task]
    if c.depth is not None:
        meta.append(f"depth {c.depth:g}")
    if c.length is not None:
        meta.append(f"{c.length} tokens")
    out = [f'<article class="item {c.kind}" data-task="{e(c.task)}" data-id="{e(c.id)}" '
           f'id="item-{e(run)}-{e(re.sub(r"[^A-Za-z0-9._-]+", "_", c.id))}">',
           f'<h4>{e(c.id)} <span class="meta">{e(" · ".join(meta))}</span></h4>']
    if c.question:
        out.append(f'<p class="q"><b>Question:</b> {e(c.question)}</p>')
    if c.needle:
        out.append(f'<p class="q"><b>Needle:</b> {e(c.needle)}</p>')
    if c.passage:
        p = c.passage
        out.append(f'<blockquote class="ctx">{"… " if p.clipped_before else ""}{e(p.before)}<mark>{e(p.needle)}</mark>'
                   f'{e(p.after)}{" …" if p.clipped_after else ""}</blockquote>')
    out.append(_document(c))
    out.append('<table class="answers"><thead><tr><th>gold</th><th>baseline</th><th>candidate</th></tr></thead><tbody><tr>'
               f'<td class="gold"><pre class="answer gold">{e(" | ".join(c.gold))}</pre></td>'
               + _answer_cell("baseline", c.baseline) + _answer_cell("candidate", c.candidate) + "</tr></tbody></table>")
    if c.kept:
        out.append(f'<p class="kept">{e(c.kept)}</p>')
    out.append("</article>")
    return "".join(out)


_KIND_TITLES = {
    "regressed": "Regressed: right at baseline, wrong under the policy",
    "improved": "Improved: wrong at baseline, right under the policy",
    "changed": "Wrong in both runs, in another category",
}


def _items_section(r: Row, v: Verdict, changes: RunChanges, run: str, tasks: Sequence[str]) -> str:
    out = [f'<section class="items" id="items-{e(run)}" {_row_attrs(r, v)}>',
           f"<h2>{e(r.info.model)} \u00b7 {e(r.label)}: items before and after</h2>",
           f'<p class="{e(v.status)}">{e(v.sentence)}</p>', '<p><a href="#top">back to the leaderboard</a></p>']
    if changes.note:
        out.append(f'<p class="note">{e(changes.note)}</p>')
    if not changes.items:
        out.append('<p class="note">No item changed its outcome.</p>')
    for t in tasks:
        task_items = [c for c in changes.items if c.task == t]
        if not task_items:
            continue
        out.append(f'<div class="task" data-task="{e(t)}" id="{e(task_anchor(run, t))}"><h3>{e(t)}</h3>')
        for kind in KINDS:
            group = changes.of(kind, t)
            if group:
                out.append(f"<h4>{e(_KIND_TITLES[kind])} ({len(group)})</h4>")
                out.extend(_item(c, run) for c in group)
        out.append("</div>")
    out.append("</section>")
    return "".join(out)


# ----------------------------------------------------------------------------- the page


def to_html(rows: Sequence[Row], tasks: Sequence[str], plots: Sequence[Path], deployment_lines: Sequence[str] = (),
            changes: Mapping[str, RunChanges] | None = None) -> str:
    """The page (see the module docstring). ``changes``: each compressed run's changed items by run name."""
    changes = changes or {}
    ids = anchors(rows)
    verdicts = {r.info.name: verdict(r) for r in rows}
    with_kl = any(r.fidelity for r in rows)
    out = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8"><title>kveval leaderboard</title>',
        f"<style>{_CSS}</style></head><body>",
        '<h1 id="top">kveval leaderboard</h1>',
    ]
    out += _verdicts(rows, verdicts, ids)
    if deployment_lines:
        out.append('<ul class="gate">' + "".join(f"<li>{e(g)}</li>" for g in deployment_lines) + "</ul>")
    out += [
        "<h2>Leaderboard</h2>",
        '<p class="note">Click a column header to sort; click a run\'s cell to see the items it changed (a task\'s '
        "score: that task's). Per-task cells: mean score (change vs the model's baseline). <i>change [CI]</i>: all items pooled, "
        "95% Tango score interval (each item's score change as a discordance; mostly graded tasks: paired bootstrap). "
        "<i>-flips</i>: share of items right at baseline and wrong under the policy. "
        f"<i>confusion</i>: share of items answered with a wrong value. {STAR} marks the best value per model. "
        "Filtering to a task gives these columns over that task's items; filtering to a family (selection, structure, "
        "quantization) keeps the runs whose policy holds one of it, and the baseline.</p>",
        _filters(rows, tasks, verdicts),
    ]
    out += _table(rows, tasks, verdicts, ids, with_kl)
    modes = modes_table(rows)
    if modes:
        out += ["<h2>Query-agnostic and query-aware</h2>",
                '<p class="note">The same policies compressing the context before the question is seen (agnostic) and '
                "with the question in view (aware).</p>",
                '<table class="modes"><thead><tr>' + "".join(f"<th>{e(h)}</th>" for h in MODES_HEADER) + "</tr></thead><tbody>"
                + "".join("<tr>" + "".join(f"<td>{e(c)}</td>" for c in line) + "</tr>" for line in modes) + "</tbody></table>"]
    if plots:
        out.append("<h2>Plots</h2>")
    for p in plots:
        data = base64.b64encode(Path(p).read_bytes()).decode("ascii")
        out.append(f'<figure><img alt="{e(p.stem)}" src="data:image/png;base64,{data}"><figcaption>{e(p.stem)}</figcaption></figure>')
    for r in rows:
        if r.comparison is not None and r.info.name in changes:
            out.append(_items_section(r, verdicts[r.info.name], changes[r.info.name], ids[r.info.name], tasks))
    out.append(f"<script>{_JS}</script>")
    out.append("</body></html>")
    return "\n".join(out) + "\n"


__all__ = ["anchors", "task_anchor", "to_html"]
