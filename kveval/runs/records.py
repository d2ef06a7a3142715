"""Per-item result files: the one format every kveval command reads and writes.

A *run* is one model evaluated under one policy (or the baseline) on a fixed set
of items. It lives in a folder::

    <run_dir>/run.json      # what was run: RunInfo, written atomically
    <run_dir>/items.jsonl   # one JSON object per item, appended and flushed

Each line of ``items.jsonl`` is an :class:`ItemRecord` as a dict. Lines are
appended with flush + fsync, so a killed process leaves at most one partial
last line. :class:`ItemWriter` cuts such a line off before appending (so a
resumed run continues cleanly); :func:`read_items` refuses it, and any corrupt
line, because a comparison must never run on a truncated run.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Iterator

RUN_FILE = "run.json"
ITEMS_FILE = "items.jsonl"

#: Memory-confusion categories of probe items (:data:`CATEGORIES`, display order; an item of a task without the
#: taxonomy records ""), and those of wrong answers that still give a value (:data:`CONFUSION_CATEGORIES`, summed as
#: ``"overall"``): defined once, by the scorer that gives them (:mod:`kveval.probes.scoring`).
from kveval.probes.scoring import CATEGORIES, CONFUSION_CATEGORIES, VALUELESS_CATEGORIES  # noqa: E402,F401
#: Item metrics that count bytes held, never below 0 (``request_kv_bytes`` is not one: it is a difference, negative
#: where a decode budget evicted prefix tokens).
BYTE_COUNTS = ("kv_bytes", "index_bytes", "nominal_bytes", "bytes_per_token", "nominal_bytes_per_token",
               "prefix_kv_bytes", "peak_kv_bytes", "state_bytes")


from kveval.errors import ResultFileError  # noqa: E402  (re-exported: the one error hierarchy)


@dataclass
class RunInfo:
    """What a run evaluated.

    Attributes
    ----------
    name : str
        Unique name inside a sweep, e.g. ``"smollm2-135m/snapkv(ratio=0.5)"``.
    model : str
        Model name as given to :func:`kveval.runner.models.load_model`.
    policy : str
        Canonical policy spec string (``"none"`` for the baseline).
    mode : str
        ``"context"`` (compress the context before the question is seen) or
        ``"query"`` (compress context plus question).
    family : str
        Policy family label for plots: the selection policy name, else the
        representation policy name (``"none"`` for the baseline).
    ratio : float or None
        Nominal fraction of context KV pairs removed by selection, if any.
    bytes_per_token : float or None
        Measured K/V storage bytes per cached context token, averaged over items.
    nominal_bytes_per_token : float or None
        Bytes per token an uncompressed cache of the model's dtype would hold.
    kv_dtype : str or None
        Dtype of the full-precision tokens the cache held (``None``: the model's deployment dtype).
    model_identity : dict
        Which model exactly: ``name``, ``source`` (resolved path or Hub id),
        ``revision`` and ``hash`` (see :func:`kveval.runner.runspec.model_identity`);
        a run folder is never resumed for another identity.
    extra : dict
        Anything else worth recording (versions, calibration, timings).
    """

    name: str
    model: str
    policy: str
    mode: str = "context"
    family: str = "none"
    ratio: float | None = None
    bytes_per_token: float | None = None
    nominal_bytes_per_token: float | None = None
    kv_dtype: str | None = None
    model_identity: dict[str, Any] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def is_baseline(self) -> bool:
        return self.policy == "none"

    @property
    def achieved_ratio(self) -> dict[str, float]:
        """For a policy whose ratio differs per item (a threshold): the ``mean``, ``min`` and ``max`` fraction of the
        cache's bytes its items removed, as :func:`kveval.runner.evaluate.finalize_run` records it; else empty."""
        return self.extra.get("achieved_ratio") or {}

    @property
    def ratio_text(self) -> str:
        """The ratio column's text: the nominal ratio (``0.5``), or for a policy whose ratio differs per item the mean
        and range it reached (:attr:`achieved_ratio`, e.g. ``~0.44 [0.38-0.51]``)."""
        reached = self.achieved_ratio
        if reached:
            return f"~{reached['mean']:.2f} [{reached['min']:.2f}-{reached['max']:.2f}]"
        return "-" if self.ratio is None else f"{self.ratio:g}"

    @property
    def compression(self) -> float | None:
        """Uncompressed / measured bytes (2.0 means half the memory)."""
        if not self.bytes_per_token or not self.nominal_bytes_per_token:
            return None
        return self.nominal_bytes_per_token / self.bytes_per_token


@dataclass
class ItemRecord:
    """The outcome of one item under one run.

    Attributes
    ----------
    id : str
        Stable item id, the same in every run of a sweep.
    hash : str
        Content hash of the prompt (context + question); pairing checks it.
    task : str
        Task or probe family name (``"niah_multikey"``).
    score : float
        In [0, 1]; 1 is fully right. Binary tasks use 0/1.
    correct : bool
        Whether the item counts as right (``score == 1`` for probes).
    category : str
        Memory-confusion category from :mod:`kveval.probes.scoring`
        (``correct``, ``distractor``, ``stale``, ``partial``,
        ``over_inclusion``, ``fabricated``, ``no_value``, ``empty``), or ``""`` when the task
        has no taxonomy.
    answer : str
        The model's output text.
    gold : list of str
        Accepted answer(s).
    recalled : str or None
        For a wrong answer, the needle value the model gave instead and its role
        (``"distractor:7431"``), if any.
    length : int or None
        Prompt length in tokens.
    depth : float or None
        Needle depth in [0, 1], if the item has one.
    logprob_gold : float or None
        Log-probability of the gold continuation (loglikelihood tasks).
    metrics : dict
        Per-item measurements: cache bytes, timings, kept tokens, ...
    """

    id: str
    hash: str
    task: str
    score: float
    correct: bool
    category: str = ""
    answer: str = ""
    gold: list[str] = field(default_factory=list)
    recalled: str | None = None
    length: int | None = None
    depth: float | None = None
    logprob_gold: float | None = None
    metrics: dict[str, Any] = field(default_factory=dict)


def write_run_info(run_dir: str | os.PathLike, info: RunInfo) -> None:
    """Write ``run.json`` atomically (temp file + rename)."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(run_dir / RUN_FILE, json.dumps(asdict(info), indent=2, sort_keys=True))


def read_run_info(run_dir: str | os.PathLike) -> RunInfo:
    path = Path(run_dir) / RUN_FILE
    if not path.is_file():
        raise ResultFileError(f"{path}: no such run file; point at a run folder written by kveval (it holds {RUN_FILE} and {ITEMS_FILE})")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        return RunInfo(**data)
    except (json.JSONDecodeError, UnicodeDecodeError, TypeError) as exc:
        raise ResultFileError(f"{path}: corrupt run file ({exc}); delete the run folder and run it again") from exc


def is_probe_record(record: ItemRecord) -> bool:
    """A probe item's record (it measured the cache), not one of lm-eval's samples: what ``extra.items`` counts."""
    return "bytes_per_token" in record.metrics


def holds(done: int, expected: int) -> str | None:
    """``"holds 1 of 2 items"`` where ``done`` falls short of ``expected``, else ``None``: how every check of a run's
    items words a run that did not finish (:func:`missing_items`, :func:`kveval.sweep.run.unfinished`)."""
    return f"holds {done} of {expected} items" if done < expected else None


def missing_items(info: RunInfo, records: list[ItemRecord]) -> str | None:
    """Why a run folder holds fewer probe items than its ``run.json`` records, or ``None``.

    The runner records ``extra.expected_items`` when it opens a run (the items it was asked for, more when a resumed
    run is given more) and ``extra.items`` when the run finishes (:func:`kveval.runner.evaluate.finalize_run`). A run
    cut short (a killed sweep, an ``items.jsonl`` cut at a line boundary) holds fewer. A run the runner opened before
    it recorded ``expected_items`` (``extra.hardware`` written) and never finished records neither count: it did not
    finish either. Runs written by other tools record neither and are taken as they are.
    """
    counts = [info.extra.get(key) for key in ("expected_items", "items")]
    expected = max((n for n in counts if isinstance(n, int) and not isinstance(n, bool)), default=None)
    done = len({r.id for r in records if is_probe_record(r)})
    if expected is None:
        opened_by_runner = "hardware" in info.extra and done
        return "did not finish (its run.json records no finished item count)" if opened_by_runner else None
    return holds(done, expected)


def item_line(record: ItemRecord) -> str:
    """One line of ``items.jsonl``: the record as sorted JSON, newline-terminated."""
    return json.dumps(asdict(record), sort_keys=True) + "\n"


def replace_items(run_dir: str | os.PathLike, records: list[ItemRecord]) -> None:
    """Rewrite a run's ``items.jsonl`` as ``records`` (atomically: readers see the old file or the new one)."""
    atomic_write_text(Path(run_dir) / ITEMS_FILE, "".join(item_line(r) for r in records))


class ItemWriter:
    """Append :class:`ItemRecord` lines durably: one write, flush and fsync per item."""

    def __init__(self, run_dir: str | os.PathLike):
        path = Path(run_dir) / ITEMS_FILE
        path.parent.mkdir(parents=True, exist_ok=True)
        _drop_partial_last_line(path)
        self._file = open(path, "a", encoding="utf-8")

    def write(self, record: ItemRecord) -> None:
        self._file.write(item_line(record))
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "ItemWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def iter_items(run_dir: str | os.PathLike) -> Iterator[ItemRecord]:
    """Yield the records of a run; raise :class:`ResultFileError` on a truncated or corrupt file."""
    path = Path(run_dir) / ITEMS_FILE
    if not path.is_file():
        raise ResultFileError(f"{path}: no items file; run the evaluation first (kveval sweep or kveval eval)")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ResultFileError(f"{path}: not UTF-8 text, so not a kveval items file (or a damaged one); delete the run "
                              f"folder and run it again") from None
    if text and not text.endswith("\n"):
        raise ResultFileError(f"{path}: truncated (the last line was cut off mid-write); rerun the sweep to complete it")
    for number, line in enumerate(text.split("\n"), start=1):
        if not line.strip():
            continue
        try:
            yield ItemRecord(**json.loads(line))
        except (json.JSONDecodeError, TypeError) as exc:
            raise ResultFileError(f"{path}:{number}: corrupt item line ({exc}); delete the run folder and run it again") from exc


def written_hashes(run_dir: str | os.PathLike) -> dict[str, str]:
    """The prompt hash of every item ``run_dir`` holds, by id; empty where it was not run yet or a killed writer left
    a half line (the evaluation that resumes it rewrites what is missing)."""
    try:
        return {r.id: r.hash for r in iter_items(run_dir)}
    except (ResultFileError, OSError):
        return {}


def read_items(run_dir: str | os.PathLike) -> list[ItemRecord]:
    return list(iter_items(run_dir))


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write a whole file so that readers see either the old or the new content.

    A path that is there and is neither a file nor a folder (``/dev/stdout``, a pipe, a device) is written in place:
    renaming a file over it would replace it. An error that names no file (a full disk fails at write time) is
    raised naming ``path``, so that its one line says where."""
    atomic_write_texts({path: text})


def atomic_write_texts(texts: "dict[str | os.PathLike, str | bytes]") -> None:
    """Write several whole files (text, or ``bytes`` as they are) so that readers see either all the old contents or
    all the new ones, as far as a file system allows: every new file is written and synced beside its old one first, and only when all are
    written do they replace the old ones (a full disk while writing the last leaves every old file whole). Paths that
    are neither files nor folders are written in place, as :func:`atomic_write_text` does."""
    staged: list[tuple[Path, Path]] = []
    current = None
    try:
        for path, text in texts.items():
            current = path = Path(path)
            if path.exists() and not path.is_file() and not path.is_dir():
                with open(path, "w", encoding="utf-8") as f:
                    f.write(text)
                continue
            tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
            staged.append((tmp, path))
            if isinstance(text, bytes):
                tmp.write_bytes(text)
            else:
                tmp.write_text(text, encoding="utf-8")
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
        for tmp, path in staged:
            current = path
            os.replace(tmp, path)
    except BaseException as exc:  # a full or read-only disk (or Ctrl-C) leaves no temporary file behind
        for tmp, _ in staged:
            tmp.unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.filename is None and exc.errno is not None:
            raise OSError(exc.errno, exc.strerror, str(current)) from None
        raise


def cut_partial_item(run_dir: str | os.PathLike) -> None:
    """Cut off a half-written last line of a run's ``items.jsonl`` (a killed writer's), so it reads and resumes cleanly."""
    _drop_partial_last_line(Path(run_dir) / ITEMS_FILE)


def _drop_partial_last_line(path: Path) -> None:
    """Truncate a cut-off last line left by a killed writer, so appends start clean."""
    if not path.is_file():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        keep = data.rfind(b"\n") + 1
        with open(path, "r+b") as f:
            f.truncate(keep)
