"""The one place exceptions become exit codes (:func:`kveval.errors.run_command`): kveval's own errors are the
user's to fix (exit 2, one line); any other exception is a bug (exit 70, with its traceback), and never exit 1,
which is the gate's FAIL."""

from __future__ import annotations

import errno

import pytest

from kveval.errors import (
    EXIT_ERROR,
    EXIT_FAIL,
    EXIT_INTERNAL,
    ConfigError,
    PolicyRegistryError,
    PolicySpecError,
    UsageError,
    run_command,
)


def _raise(exc):
    def body():
        raise exc
    return body


@pytest.mark.parametrize("exc", [UsageError("bad --context"), ConfigError("configs/x.yaml: unknown key"),
                                 PolicySpecError("snapkv: ratio=2"), FileNotFoundError(2, "No such file", "runs/x"),
                                 OSError(errno.ENOSPC, "No space left on device", "out/items.jsonl")])
def test_a_user_error_is_one_line_and_exit_2(exc, capsys):
    assert run_command("gate", _raise(exc)) == EXIT_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("kveval gate: error: ") and "Traceback" not in err


@pytest.mark.parametrize("exc", [ValueError("a bug deep inside"), TypeError("unsupported operand"),
                                 KeyError("kl_mean"), OverflowError("math range error")])
def test_any_other_exception_is_an_internal_error_with_its_traceback(exc, capsys):
    """A bare ValueError was once a user error (exit 2, no traceback): a bug raising one looked like a user's mistake."""
    code = run_command("report", _raise(exc))
    assert code == EXIT_INTERNAL and code not in (EXIT_ERROR, EXIT_FAIL)
    err = capsys.readouterr().err
    assert "Traceback" in err and f"internal error ({type(exc).__name__})" in err


def test_typed_user_errors_stay_value_errors_for_library_callers():
    assert issubclass(UsageError, ValueError) and issubclass(PolicySpecError, ValueError)
    assert issubclass(PolicyRegistryError, UsageError)


def test_the_exit_codes_are_stated_the_same_way_everywhere(capsys):
    """``kveval --help``, the README, CONTRIBUTING.md and docs/statistics.md state every exit code in the one wording
    of :data:`kveval.errors.EXIT_CODE_MEANINGS`."""
    from pathlib import Path

    from kveval.commands.main import main
    from kveval.errors import EXIT_CODE_MEANINGS, exit_codes_sentence

    root = Path(__file__).resolve().parent.parent
    assert [code for code, _ in EXIT_CODE_MEANINGS] == [0, 1, 2, 3, 70, 130]
    for name in ("README.md", "CONTRIBUTING.md", "docs/statistics.md"):
        text = " ".join((root / name).read_text(encoding="utf-8").split())
        assert exit_codes_sentence() in text, name
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    shown = capsys.readouterr().out
    assert shown.startswith("usage: kveval") and "one subcommand per module" not in shown
    for code, meaning in EXIT_CODE_MEANINGS:
        assert f"  {code:<4} {meaning}\n" in shown
