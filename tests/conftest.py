"""Fixtures shared by several test files (plain helpers live in tests/cache_runs.py and tests/tiny_models.py)."""

import pytest


@pytest.fixture
def calibration_cache(tmp_path, monkeypatch):
    """A calibration folder of this test's own (``KVEVAL_CACHE``), with no calibration remembered from another test.

    Covers the low-rank/latent/kvquant calibrations and duo's retrieval heads.
    Files use it with ``pytestmark = pytest.mark.usefixtures("calibration_cache")``;
    its value is the cache folder.
    """
    import kveval.lowrank as lowrank
    import kveval.retrieval_heads as retrieval_heads

    monkeypatch.setenv("KVEVAL_CACHE", str(tmp_path / "cache"))
    lowrank.clear_memory_cache()
    retrieval_heads.clear_memory_cache()
    yield tmp_path / "cache"
    lowrank.clear_memory_cache()
    retrieval_heads.clear_memory_cache()
