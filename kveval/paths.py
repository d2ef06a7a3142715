"""Where kveval keeps files between runs: a module with no kveval imports, so any layer may ask."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Folder for dequantized weights and calibration data (``$KVEVAL_CACHE``, default ``~/.cache/kveval``)."""
    return Path(os.environ.get("KVEVAL_CACHE", Path.home() / ".cache" / "kveval"))


__all__ = ["cache_dir"]
