"""Every config shipped in configs/ parses: a user who copies one gets a sweep or a gate, not a ConfigError."""

from pathlib import Path

import pytest

from kveval.gate.config import load_gate_config
from kveval.sweep.config import load_config

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))


def test_there_are_sweep_and_gate_configs():
    names = {p.name for p in CONFIGS}
    assert {"quickstart.yaml", "gate.yaml", "gate-cpu.yaml", "gpu-deepseek-v4-flash.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_shipped_config_parses(path):
    if path.name.startswith("gate"):
        assert all(m > 0 for m in load_gate_config(path).margin.values())
    else:
        config = load_config(path)
        assert config.models and config.policies
