"""The leaderboard page in a real browser (headless Chromium through Selenium): it renders with no console error,
sorts, filters, and a FAIL leads to the very answers ``items.jsonl`` holds.

Needs Debian's ``chromium`` and ``chromium-driver`` and ``pip install selenium`` (``bash scripts/setup.sh --test``
installs them); without them every test here skips, saying what is missing. One browser serves the module; the
pages are built once, from a copy of ``results/quickstart``'s runs (real answers) and from fixture lm-eval runs.
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest

from kveval.report.leaderboard import build_report
from kveval.runs.records import read_items, read_run_info

REPO = Path(__file__).resolve().parent.parent
QUICKSTART = REPO / "results" / "quickstart"


def _browser_or_skip():
    try:
        from selenium import webdriver
        from selenium.webdriver.chrome.options import Options
        from selenium.webdriver.chrome.service import Service
    except ImportError:
        pytest.skip("browser tests need selenium: pip install selenium (or bash scripts/setup.sh --test)")
    binary = next((shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome") if shutil.which(b)), None)
    driver = shutil.which("chromedriver")
    if not binary or not driver:
        pytest.skip("browser tests need Chromium and its driver: apt-get install chromium chromium-driver "
                    "(or bash scripts/setup.sh --test)")
    options = Options()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1400,1000"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    try:
        return webdriver.Chrome(service=Service(driver), options=options)
    except Exception as exc:  # a driver that does not match the browser, a browser that cannot start here
        pytest.skip(f"Chromium did not start under chromedriver: {str(exc).splitlines()[0]}")


@pytest.fixture(scope="module")
def browser():
    driver = _browser_or_skip()
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    """The quickstart's runs copied, and their report (no prompts: that needs the model's tokenizer)."""
    root = tmp_path_factory.mktemp("quickstart")
    shutil.copytree(QUICKSTART / "runs", root / "runs")
    paths = build_report([root], root / "report", gate_result=QUICKSTART / "gate" / "gate.json", n_resamples=999)
    return root, Path(paths["html"])


def _shown(driver, css: str):
    return [el for el in driver.find_elements("css selector", css) if el.is_displayed()]


def _open(driver, page: Path, fragment: str = "") -> None:
    driver.get(page.as_uri() + fragment)


def _follow(driver, link) -> None:
    """Click a link into an item view and wait until the page has routed to it: the hash changes at once, the
    section shows on the ``hashchange`` event after it (reading the page in between saw half of it)."""
    from selenium.webdriver.support.ui import WebDriverWait

    fragment = "#" + link.get_attribute("href").split("#", 1)[1]
    link.click()
    WebDriverWait(driver, 10).until(lambda d: d.execute_script("return location.hash") == fragment
                                    and _shown(d, "section.items"))


def _policies_shown(driver) -> list[str]:
    return [row.find_elements("tag name", "td")[2].text for row in _shown(driver, "#leaderboard tbody tr")]


def test_the_page_renders_with_no_console_error(browser, quickstart):
    _open(browser, quickstart[1])
    png = browser.get_screenshot_as_png()
    from matplotlib.image import imread

    pixels = imread(io.BytesIO(png))
    assert pixels.shape[0] > 500 and pixels.std() > 0.05  # not a blank page
    assert browser.title == "kveval leaderboard"
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []
    assert len(_shown(browser, "#leaderboard tbody tr")) == 4
    assert _shown(browser, "section.items") == []  # item views open from a link


def test_a_column_sorts_each_way(browser, quickstart):
    _open(browser, quickstart[1])
    header = next(th for th in browser.find_elements("css selector", "#leaderboard th") if th.text == "bytes/token")
    runs = [read_run_info(p) for p in sorted((quickstart[0] / "runs").glob("*/*"))]
    label = {i.policy: ("baseline" if i.policy == "none" else i.policy) for i in runs}
    by_bytes = [label[i.policy] for i in sorted(runs, key=lambda i: i.bytes_per_token)]
    header.click()
    assert header.get_attribute("aria-sort") == "ascending"
    assert _policies_shown(browser) == by_bytes
    header.click()
    assert header.get_attribute("aria-sort") == "descending"
    assert _policies_shown(browser) == by_bytes[::-1]


def test_filters_keep_one_task_and_one_verdict(browser, quickstart):
    from selenium.webdriver.support.ui import Select

    _open(browser, quickstart[1])
    Select(browser.find_element("id", "f-task")).select_by_value("passkey")
    headers = [th.text for th in _shown(browser, "#leaderboard th")]
    assert "passkey" in headers and "niah_single" not in headers
    assert len(_shown(browser, '#leaderboard td[data-task="niah_single"]')) == 0
    assert len(_shown(browser, '#leaderboard td[data-task="passkey"]')) == 4
    Select(browser.find_element("id", "f-verdict")).select_by_value("FAIL")
    assert sorted(_policies_shown(browser)) == ["random(ratio=0.5)", "streaming(sink=4,window=60)"]
    assert len(_shown(browser, "div.verdict")) == 2
    Select(browser.find_element("id", "f-verdict")).select_by_value("")
    Select(browser.find_element("id", "f-task")).select_by_value("")
    assert len(_shown(browser, "#leaderboard tbody tr")) == 4


def test_a_fail_leads_to_its_items_with_the_recorded_answers(browser, quickstart):
    root, page = quickstart
    _open(browser, page)
    row = next(r for r in _shown(browser, "#leaderboard tbody tr") if "streaming" in r.text)
    _follow(browser, row.find_element("css selector", "td.FAIL a"))
    sections = _shown(browser, "section.items")
    assert [s.get_attribute("id") for s in sections] == ["items-smollm2-135m_streaming_sink_4_window_60"]
    base = {r.id: r for r in read_items(root / "runs" / "smollm2-135m" / "none")}
    cand = {r.id: r for r in read_items(root / "runs" / "smollm2-135m" / "streaming_sink-4_window-60")}
    expected = {i for i in cand if base[i].correct != cand[i].correct  # the items it ran (stopped at look 1)
                or (not base[i].correct and base[i].category != cand[i].category)}
    shown = browser.execute_script(  # one round trip for every article: what the page shows of it
        "return Array.from(arguments[0].querySelectorAll('article.item')).map(a => [a.dataset.id,"
        " a.querySelector('pre.answer.baseline').textContent, a.querySelector('pre.answer.candidate').textContent,"
        " a.offsetParent !== null])", sections[0])
    assert sorted(i for i, *_ in shown) == sorted(expected) and len(shown) == 29  # of the 30 it ran
    assert all(visible for *_, visible in shown)
    assert {i: (b, c) for i, b, c, _ in shown} == {i: (base[i].answer, cand[i].answer) for i in expected}
    first = sections[0].find_element("css selector", "article.item")
    assert "regressed" in first.get_attribute("class") and "no_value" in first.text
    assert first.find_element("tag name", "h4").text.startswith(f"{first.get_attribute('data-id')} ")
    # a task score links to that task's items
    _open(browser, page)
    cell = next(r for r in _shown(browser, "#leaderboard tbody tr") if "random" in r.text)
    _follow(browser, cell.find_element("css selector", 'td[data-task="niah_single"] a'))
    assert browser.execute_script("return location.hash") == "#items-smollm2-135m_random_ratio_0.5--niah_single"
    assert [s.get_attribute("id") for s in _shown(browser, "section.items")] == ["items-smollm2-135m_random_ratio_0.5"]
    _shown(browser, "a[href='#top']")[0].click()  # back, then any other cell of the row
    cell = next(r for r in _shown(browser, "#leaderboard tbody tr") if "random" in r.text)
    _follow(browser, cell.find_elements("tag name", "td")[-1].find_element("tag name", "a"))
    assert browser.execute_script("return location.hash") == "#items-smollm2-135m_random_ratio_0.5"


def test_the_page_has_one_score_against_compression_plot(browser, quickstart):
    """The inline SVG scatter of score against bytes per token drew what score_vs_compression.png draws; one stays,
    the PNG (the markdown's too)."""
    _open(browser, quickstart[1])
    assert browser.find_elements("css selector", "svg") == []
    assert [i.get_attribute("alt") for i in browser.find_elements("css selector", "figure img")] == [
        "score_vs_compression", "heatmap_smollm2-135m", "confusion_smollm2-135m"]


def test_the_family_filter_offers_families_and_the_policy_filter_specs(browser, quickstart):
    from selenium.webdriver.support.ui import Select

    _open(browser, quickstart[1])
    family, policy = (Select(browser.find_element("id", f"f-{f}")) for f in ("family", "policy"))
    assert [o.get_attribute("value") for o in family.options] == ["", "selection", "quantization"]
    assert [o.get_attribute("value") for o in policy.options] == [
        "", "baseline", "quant(bits=8,group=16)", "random(ratio=0.5)", "streaming(sink=4,window=60)"]
    family.select_by_value("selection")
    assert _policies_shown(browser) == ["baseline", "random(ratio=0.5)", "streaming(sink=4,window=60)"]
    assert len(_shown(browser, "div.verdict")) == 2
    family.select_by_value("quantization")
    assert _policies_shown(browser) == ["baseline", "quant(bits=8,group=16)"]
    family.select_by_value("")
    policy.select_by_value("random(ratio=0.5)")
    assert _policies_shown(browser) == ["random(ratio=0.5)"]
    policy.select_by_value("")
    assert len(_shown(browser, "#leaderboard tbody tr")) == 4


def test_the_pooled_columns_follow_the_task_filter(browser, quickstart):
    """All items, change [CI], -flips and confusion stayed pooled over every task when the page was filtered to one;
    now they are that task's, as the gate judges it, and sorting reads the values shown."""
    from selenium.webdriver.support.ui import Select

    from kveval.report.rows import collect_rows

    root, page = quickstart
    rows, tasks = collect_rows([root], n_resamples=999)
    _open(browser, page)
    header = [th.text for th in _shown(browser, "#leaderboard th")]
    col = {name: header.index(name) for name in ("all items", "change [CI]", "-flips", "confusion")}

    def shown_cells():
        return {tr.find_elements("tag name", "td")[2].text: [tr.find_elements("tag name", "td")[k].text.rstrip(" \u2605")
                                                              for k in col.values()]
                for tr in _shown(browser, "#leaderboard tbody tr")}

    def expected(task):
        out = {}
        for r in rows:
            c = None if r.comparison is None else (r.comparison.task(task) if task else r.comparison.overall)
            score = r.task_scores[task] if task else r.score
            conf = r.task_confusion[task] if task else r.confusion_rate
            out[r.label] = [f"{score:.3f}",
                            "baseline" if c is None else f"{c.delta:+.3f} [{c.ci_low:+.3f}, {c.ci_high:+.3f}]",
                            "-" if c is None else f"{c.negative_flip_rate * 100:.1f}%", f"{conf:.1%}"]
        return out

    assert shown_cells() == expected(None)
    for task in tasks:
        Select(browser.find_element("id", "f-task")).select_by_value(task)
        assert browser.find_elements("css selector", "#leaderboard th")[col["all items"]].text == f"{task} items"
        assert shown_cells() == expected(task)
        assert shown_cells() != expected(None)
    # sorting by the change column orders by the shown task's change
    task = tasks[0]
    Select(browser.find_element("id", "f-task")).select_by_value(task)
    changes = {r.label: (0.0 if r.comparison is None else r.comparison.task(task).delta) for r in rows}
    th = [t for t in _shown(browser, "#leaderboard th") if t.text == "change [CI]"][0]
    th.click()
    assert _policies_shown(browser) == sorted(changes, key=changes.get)
    Select(browser.find_element("id", "f-task")).select_by_value("")
    assert shown_cells() == expected(None)


def test_an_lm_eval_item_shows_its_document_and_both_answers(browser, tmp_path):
    from test_report_items import lm_eval_sample, write_lm_eval

    base = write_lm_eval(tmp_path / "lm_base", [lm_eval_sample(d, [-3.0, -1.0, -2.5]) for d in range(6)],
                         "pretrained=smollm2-135m")
    cand = write_lm_eval(tmp_path / "lm_cand",
                         [lm_eval_sample(d, [-0.5, -1.5, -2.5] if d in (1, 3) else [-3.0, -1.0, -2.5]) for d in range(6)],
                         "pretrained=smollm2-135m,policy=snapkv(ratio=0.5)")
    page = Path(build_report([base, cand], tmp_path / "rep", n_resamples=999)["html"])
    _open(browser, page)
    _follow(browser, browser.find_element("css selector", "#leaderboard td.l a"))
    articles = _shown(browser, "section.items article.item")
    assert [a.get_attribute("data-id") for a in articles] == ["arc_easy/1", "arc_easy/3"]
    first = articles[0]
    assert first.find_element("css selector", "pre.prompt").text == "Question 1: which colour is the sky?"
    choices = [li.text for li in first.find_elements("css selector", "ol li")]
    assert choices == ["green \u2190 candidate", "blue \u2190 baseline", "red"]
    assert json.loads(first.find_element("css selector", "pre.doc").get_attribute("textContent"))["choices"] == [
        "green", "blue", "red"]
    assert [e for e in browser.get_log("browser") if e["level"] == "SEVERE"] == []
