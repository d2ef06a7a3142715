"""The command line itself: ``--version``, help for every option, the sweep's progress labels, gate configs by name."""

import argparse
import importlib
from pathlib import Path

import pytest

import kveval
from kveval.commands.main import COMMANDS, main
from kveval.errors import ConfigError

REPO = Path(__file__).resolve().parent.parent


def test_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0 and capsys.readouterr().out == f"kveval {kveval.__version__}\n"
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--version" in capsys.readouterr().out


@pytest.mark.parametrize("command", [c for c in COMMANDS if c != "lm-eval"])  # lm-eval's options are lm-eval's
def test_every_option_says_what_it_does(command):
    """``kveval eval --help`` showed --model, --seed, --mode and --batch-size with no word of what they do."""
    parser = argparse.ArgumentParser()
    importlib.import_module(COMMANDS[command][0]).configure(parser)
    silent = [a.option_strings[0] if a.option_strings else a.dest for a in parser._actions if not (a.help or "").strip()]
    assert silent == []


def test_a_cells_progress_label_names_what_it_counts():
    """The bar said ``smollm2-135m: none +3``."""
    from kveval.runner.runspec import RunSpec
    from kveval.sweep.executors import Cell
    from kveval.sweep.run import progress_label

    specs = [RunSpec.parse(s) for s in ("none", "quant(bits=8)", "window(16)", "random(ratio=0.5)")]
    assert progress_label(Cell("smollm2-135m", "context", tuple(specs))) == "smollm2-135m: none and 3 other policies"
    assert progress_label(Cell("models/tiny", "context", tuple(specs[:2]))) == "tiny: none and 1 other policy"
    assert progress_label(Cell("smollm2-135m", "context", tuple(specs[:1]))) == "smollm2-135m: none"


# --- gate configs shipped, by name ---------------------------------------------------------------------------

def test_gate_configs_ship_in_the_package_and_configs_links_to_them():
    from kveval.gate.config import load_gate_config, shipped_gate_configs

    shipped = shipped_gate_configs()
    assert set(shipped) == {"default", "cpu"}
    assert all(path.parent == Path(kveval.__file__).parent / "gate" / "configs" for path in shipped.values())
    # one source of truth: the checkout's configs/ names the same files
    assert (REPO / "configs" / "gate.yaml").resolve() == shipped["default"].resolve()
    assert (REPO / "configs" / "gate-cpu.yaml").resolve() == shipped["cpu"].resolve()
    assert '"gate/configs/*.yaml"' in (REPO / "pyproject.toml").read_text()  # package data: a pip install has them
    assert load_gate_config("cpu").margin == {"default": 0.10}
    assert load_gate_config("default") == load_gate_config(None)  # the shipped default is the built-in rules
    assert load_gate_config("cpu") == load_gate_config(REPO / "configs" / "gate-cpu.yaml")  # a path still works


def test_an_unknown_gate_name_is_one_line_listing_the_names():
    from kveval.gate.config import load_gate_config

    with pytest.raises(ConfigError) as error:
        load_gate_config("cpux")
    assert str(error.value) == ("no gate config named 'cpux': kveval ships cpu, default; or give the path of a gate "
                                "YAML")
    with pytest.raises(ConfigError, match="no such gate config"):
        load_gate_config("nowhere/gate.yaml")


def test_a_copied_sweep_config_finds_its_gate_by_name(tmp_path):
    """A sweep config copied out of configs/ failed with "no such gate config" (its gate was a path beside it)."""
    from kveval.gate.config import load_gate_config
    from kveval.sweep.config import load_config, with_gate

    copied = tmp_path / "elsewhere" / "my-sweep.yaml"
    copied.parent.mkdir()
    copied.write_text((REPO / "configs" / "quickstart.yaml").read_text())
    config = load_config(copied)
    assert config.raw["gate"] == "cpu" and config.gate == load_gate_config("cpu")
    copied.write_text(copied.read_text().replace("gate: cpu", "gate: default"))
    assert load_config(copied).gate.margin == {"default": 0.05}
    copied.write_text(copied.read_text().replace("gate: default", "gate: strict"))
    with pytest.raises(ConfigError, match="no gate config named 'strict': kveval ships cpu, default"):
        load_config(copied)
    copied.write_text(copied.read_text().replace("gate: strict", "gate: rules/mine.yaml"))
    (tmp_path / "elsewhere" / "rules").mkdir()
    (tmp_path / "elsewhere" / "rules" / "mine.yaml").write_text("margin: 0.2\n")  # a path: beside the config
    assert load_config(copied).gate.margin == {"default": 0.2}
    assert with_gate(load_config(copied), "cpu").gate == load_gate_config("cpu")  # --gate cpu
    assert load_config(copied).hash == with_gate(load_config(copied), "cpu").hash  # the gate is outside the hash


def test_gate_command_takes_a_name(capsys):
    runs = REPO / "results" / "quickstart" / "runs" / "smollm2-135m"
    code = main(["gate", "--gate", "cpu", "--baseline", str(runs / "none"), "--candidate", str(runs / "quant_bits-8_group-16")])
    assert code == 0 and capsys.readouterr().out.strip().endswith("gate: PASS (exit 0)")
    assert main(["gate", "--gate", "nope", "--baseline", str(runs / "none"), "--candidate", str(runs / "none")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no gate config named 'nope': kveval ships cpu, default" in err
