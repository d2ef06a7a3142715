"""Which command a results folder belongs to: a sweep's folder is its sweep's, and no other command writes into it.

A sweep records itself in ``<out>/manifest.json`` (:data:`MANIFEST_FILE`: the command, the config and its hash);
its runs, gate and report are paired with each other and with that config. A run another command adds there
would leave them unpaired (and the sweep unable to resume), and a report or gate written over the sweep's would
no longer be the sweep's. :func:`refuse_sweep_folder` is asked by every command that writes a folder the user
names, before anything runs.
"""

from __future__ import annotations

import json
from pathlib import Path

from kveval.errors import RunFolderError

#: A sweep folder's record of what made it (:mod:`kveval.sweep.run`).
MANIFEST_FILE = "manifest.json"
#: What a sweep writes inside its folder: a folder of a name of one's own beside them is not the sweep's.
SWEEP_OWNS = ("runs", "noise_floor", "gate", "report")


def sweep_holding(path: Path) -> tuple[Path, dict] | None:
    """The sweep folder ``path`` is (or lies inside), and its manifest as far as it reads; ``None`` outside any."""
    path = Path(path).absolute()
    for folder in (path, *path.parents):
        manifest_path = folder / MANIFEST_FILE
        if manifest_path.is_file():
            try:
                manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
            except (OSError, ValueError):
                manifest = {}
            return folder, manifest if isinstance(manifest, dict) else {}
    return None


def refuse_sweep_folder(out: Path, command: str, instead: str) -> None:
    """Refuse (:class:`RunFolderError`, one line) to let ``kveval <command>`` write into ``out`` where it is a sweep's
    folder or what the sweep writes inside it (:data:`SWEEP_OWNS`); ``instead`` says what to do."""
    found = sweep_holding(out)
    if found is None:
        return
    folder, manifest = found
    inside = Path(out).absolute().relative_to(folder).parts
    if inside and inside[0] not in SWEEP_OWNS:
        return
    made_by = f"kveval sweep {manifest['config_path']}" if manifest.get("config_path") else "kveval sweep"
    where = "" if folder == Path(out).absolute() else f" (inside {folder})"
    raise RunFolderError(f"{out}{where} holds the sweep {manifest.get('name', '?')!r} made by {made_by} (config "
                         f"hash {manifest.get('config_hash')}); kveval {command} does not write into it: {instead}")


__all__ = ["MANIFEST_FILE", "refuse_sweep_folder", "sweep_holding"]
