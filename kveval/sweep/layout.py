"""Where a sweep writes besides its runs: the noise floor's folder and batch size (torch-free)."""

from __future__ import annotations

from pathlib import Path

#: Where each model's baseline, run a second time in another batch arrangement, goes: ``<out>/noise_floor/runs/...``,
#: beside ``<out>/runs/`` and never among the runs that are reported and gated as candidates.
NOISE_FLOOR_DIR = "noise_floor"


def noise_floor_batch_size(batch_size: int) -> int:
    """The noise floor's batch size: another one than the sweep's (half of it, or 2 for a sweep of single items)."""
    return batch_size // 2 if batch_size > 1 else 2


def noise_floor_run(out: Path, baseline_dir: Path) -> Path:
    """The noise-floor run folder of the baseline run folder ``baseline_dir`` of the sweep folder ``out``."""
    return Path(out) / NOISE_FLOOR_DIR / Path(baseline_dir).relative_to(out)
