"""Where a sweep's cells run: in this process (default) or as tasks on a Ray cluster.

A *cell* is one model, one mode and one group of policies that share a prefill
(:func:`kveval.runner.generation.shares_prefill`; the baseline ``none`` is a group of
its own), over all of the sweep's probe items and lm-eval tasks. Each run
folder belongs to exactly one cell, so a folder always has one writer, as the
resume logic of :mod:`kveval.runner.evaluate` assumes; cells only append items
(through :class:`kveval.runs.records.ItemWriter`) and never touch the sweep's
manifest, lock or report, which stay with the driver.

An executor only schedules: it calls a picklable ``work(cell) -> CellResult``
(built by :mod:`kveval.sweep.run`) once per cell and returns the results in the
order of the cells. Ray is an optional dependency (``pip install 'kveval[ray]'``),
imported only when the Ray executor is chosen.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

from kveval.errors import UsageError
from kveval.runner.runspec import RunSpec

EXECUTORS = ("inprocess", "ray")
RAY_INSTALL = "pip install 'kveval[ray]'"


@dataclass(frozen=True)
class Cell:
    """One unit of a sweep: ``specs`` (one prefill-sharing group, same mode) on ``model``, over every item and task."""

    model: str
    mode: str
    specs: tuple[RunSpec, ...]

    @property
    def label(self) -> str:
        return f"{self.model}: {', '.join(s.spec for s in self.specs)}"


@dataclass
class CellResult:
    """What a finished cell reports: its run folders (in the order of its specs), on CUDA its peak memory, and
    whether it was complete already (a resumed sweep's cell: nothing was run, no weights loaded)."""

    run_dirs: list[str]
    cuda_peak_allocated_bytes: int | None = None
    info: dict = field(default_factory=dict)
    already_complete: bool = False


CellWork = Callable[[Cell], CellResult]
#: Told of each finished cell, with its result (``None`` where the cell failed).
Progress = Callable[[Cell, "CellResult | None"], None]


class Executor(Protocol):
    """Runs every cell once through ``work``; returns their results in the order of ``cells``.

    A cell that fails does not stop the others: they finish (their items are
    written), then the first failure is raised. A ``progress`` callback (:data:`Progress`) is told of each cell as it
    finishes.
    """

    #: Whether cells may run at the same time (a sequential sweep's cells of one model share its baseline's run).
    concurrent: bool

    def run(self, cells: list[Cell], work: CellWork) -> list[CellResult]: ...


class InProcessExecutor:
    """Cells one after another in this process (``work`` may keep a loaded model between cells of one model)."""

    concurrent = False

    def __init__(self, progress: Progress | None = None):
        self.progress = progress

    def run(self, cells: list[Cell], work: CellWork) -> list[CellResult]:
        results = []
        for cell in cells:
            results.append(work(cell))
            if self.progress is not None:
                self.progress(cell, results[-1])
        return results


class RayExecutor:
    """Each cell is a Ray task claiming one GPU when the cluster has GPUs, else one CPU.

    ``address``: an existing cluster (``auto``, ``ray://host:10001``, ...); kveval
    must be installed on its nodes and the sweep folder reachable from them at the
    same path. Without an address a local cluster is started with ``workers``
    CPUs (default: all) and shut down at the end. A task lost with its node is
    retried by Ray; the retry resumes from the items already written.
    """

    concurrent = True

    def __init__(self, address: str | None = None, workers: int | None = None, progress: Progress | None = None):
        self.ray = import_ray()
        self.address, self.workers, self.progress = address, workers, progress

    def run(self, cells: list[Cell], work: CellWork) -> list[CellResult]:
        ray = self.ray
        started = not ray.is_initialized()
        if started:
            if self.address:
                ray.init(address=self.address, log_to_driver=False)
            else:
                ray.init(num_cpus=self.workers, include_dashboard=False, log_to_driver=False)
        try:
            claim = {"num_gpus": 1} if ray.cluster_resources().get("GPU", 0) >= 1 else {"num_cpus": 1}
            task = ray.remote(_run_cell).options(**claim)
            refs = [task.remote(work, cell) for cell in cells]
            pending, by_ref = list(refs), dict(zip(refs, cells))
            while pending:  # wait for every cell, so a failure elsewhere never abandons written work
                done, pending = ray.wait(pending, num_returns=1)
                if self.progress is not None:
                    try:
                        finished = ray.get(done[0])
                    except Exception:  # noqa: BLE001 - the failure is raised below, once every cell is collected
                        finished = None
                    self.progress(by_ref[done[0]], finished)
            results, first_error = [], None
            for ref in refs:
                try:
                    results.append(ray.get(ref))
                except Exception as exc:  # noqa: BLE001 - re-raised below, after every cell has been collected
                    first_error = first_error or exc
            if first_error is not None:
                raise _unwrap(first_error)
            return results
        finally:
            if started:
                ray.shutdown()


def _run_cell(work: CellWork, cell: Cell) -> CellResult:
    return work(cell)


def _unwrap(exc: BaseException) -> BaseException:
    """The cell's own exception out of Ray's wrapper, so the CLI maps it to the right exit code."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def import_ray():
    """Import Ray, or raise a one-line :class:`UsageError` naming the install command."""
    try:
        import ray
    except ImportError:
        raise UsageError(f"--executor ray needs Ray, which is not installed; install it with: {RAY_INSTALL}") from None
    return ray


def make_executor(name: str, address: str | None = None, workers: int | None = None,
                  progress: Progress | None = None) -> Executor:
    """The executor called ``name`` (one of :data:`EXECUTORS`)."""
    if name == "inprocess":
        if address:
            raise UsageError("--address needs --executor ray")
        return InProcessExecutor(progress)
    if name == "ray":
        return RayExecutor(address, workers, progress)
    raise UsageError(f"--executor {name!r}; use one of {', '.join(EXECUTORS)}")
