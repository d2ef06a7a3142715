"""Where kveval keeps files between runs, and the data files it ships: a module with no kveval imports, so any
layer may ask."""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """Folder for dequantized weights and calibration data (``$KVEVAL_CACHE``, default ``~/.cache/kveval``)."""
    return Path(os.environ.get("KVEVAL_CACHE", Path.home() / ".cache" / "kveval"))


#: The calibration text kveval ships (public-domain prose), read where a policy's ``calibration=`` names none.
DEFAULT_CALIBRATION = Path(__file__).parent / "data" / "calibration.txt"


__all__ = ["DEFAULT_CALIBRATION", "cache_dir"]
