"""Fixtures shared by several test files (plain helpers live in tests/cache_runs.py and tests/tiny_models.py)."""

import pytest


@pytest.fixture
def calibration_cache(tmp_path, monkeypatch):
    """A calibration folder of this test's own (``KVEVAL_CACHE``), with no calibration remembered from another test.

    Covers the low-rank/latent/kvquant calibrations and duo's retrieval heads.
    Files use it with ``pytestmark = pytest.mark.usefixtures("calibration_cache")``;
    its value is the cache folder.

    The embedded models' dequantized weights are not calibrations: ``models/`` links to the shared folder, so a
    test loading Gemma 3 does not convert its GGUF again (about 100 s on 2 cores).
    """
    import kveval.calibration.kv as calibration
    import kveval.calibration.retrieval_heads as retrieval_heads
    from kveval.paths import cache_dir

    shared_models = cache_dir() / "models"
    shared_models.mkdir(parents=True, exist_ok=True)
    (tmp_path / "cache").mkdir()
    (tmp_path / "cache" / "models").symlink_to(shared_models, target_is_directory=True)
    monkeypatch.setenv("KVEVAL_CACHE", str(tmp_path / "cache"))
    calibration.clear_memory_cache()
    retrieval_heads.clear_memory_cache()
    yield tmp_path / "cache"
    calibration.clear_memory_cache()
    retrieval_heads.clear_memory_cache()


@pytest.fixture(scope="module")
def tok():
    """SmolLM2-135M's shipped tokenizer (chat template included), named as kveval names the model."""
    from kveval.modeling.sources import load_tokenizer

    tokenizer = load_tokenizer("smollm2-135m")
    tokenizer.kveval_name = "smollm2-135m"
    return tokenizer
