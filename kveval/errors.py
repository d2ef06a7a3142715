"""The one error hierarchy of kveval, and the exit codes it maps to.

Every error a user can cause (a bad spec, config, path, result file or model)
is a :class:`KvevalError` subclass with a one-line message that names the fix.
The command lines (:mod:`kveval.commands.main`, ``python -m kveval.lm_eval``) map exceptions to exit codes here, in
one place (:func:`run_command`):

====  ==========================================================================
0     success; for ``gate``: PASS (non-inferiority shown within the margin)
1     ``gate`` FAIL only: a loss larger than the margin, or a regression rule
      fired with statistical support. Nothing else ever exits 1.
2     a user error: bad input, a missing or corrupt file, a full or read-only disk, an
      output path through a file (a :class:`KvevalError`, or the file system's own errors for a path)
3     ``gate`` INCONCLUSIVE: too few items to show either PASS or FAIL
70    an internal error: any other exception is a bug in kveval, printed with its traceback
      (``EX_SOFTWARE`` of BSD's sysexits)
130   interrupted (Ctrl-C); results written so far are kept
====  ==========================================================================
"""

from __future__ import annotations

import errno
import os
import sys
import traceback

EXIT_OK = 0
EXIT_PASS = 0
EXIT_FAIL = 1
EXIT_ERROR = 2
EXIT_INCONCLUSIVE = 3
EXIT_INTERNAL = 70
EXIT_INTERRUPTED = 130

#: Each exit code and its one meaning, worded once: ``kveval --help``, the README, CONTRIBUTING.md and
#: docs/statistics.md state them as :func:`exit_codes_sentence` writes them (tests/test_errors.py checks).
EXIT_CODE_MEANINGS = (
    (EXIT_OK, "success or gate PASS"),
    (EXIT_FAIL, "gate FAIL, nothing else"),
    (EXIT_ERROR, "a user error, one line on stderr"),
    (EXIT_INCONCLUSIVE, "gate INCONCLUSIVE (0 with inconclusive_blocks: false)"),
    (EXIT_INTERNAL, "an internal error, a bug printed with its traceback"),
    (EXIT_INTERRUPTED, "interrupted, results written so far kept"),
)


def exit_codes_sentence() -> str:
    """``"0 success or gate PASS; 1 gate FAIL, nothing else; ..."``: every exit code with its meaning."""
    return "; ".join(f"{code} {meaning}" for code, meaning in EXIT_CODE_MEANINGS) + "."


class KvevalError(Exception):
    """Base of every error kveval reports to the user as one line (exit 2)."""

    exit_code = EXIT_ERROR


class UsageError(KvevalError, ValueError):
    """Bad input: an argument, a config file, a spec. Also a ``ValueError`` for library callers."""


class PolicySpecError(UsageError):
    """A policy spec that does not parse or validate (unknown name, wrong type, out of range)."""


class PolicyRegistryError(UsageError):
    """A policy class that cannot join the registry: not a concrete policy, a malformed name, or a name taken."""


class ConfigError(UsageError):
    """A sweep or gate config that does not validate."""


class ResultFileError(UsageError):
    """A result file is missing, corrupt, or does not pair with another."""


class ModelNotFoundError(KvevalError, RuntimeError):
    """The requested model is not installed or does not exist."""


class UnsupportedModelError(KvevalError):
    """An architecture kveval cannot evaluate exactly; refused rather than mis-evaluated."""


class RunFolderError(UsageError):
    """A run or sweep folder that belongs to another model, config or process (locked)."""


class StorageError(KvevalError, OSError):
    """The disk refused a write (full, read-only, no permission)."""


#: A path the user gave that cannot be one: through a file, a file where a folder goes, a folder where a file goes.
_PATH_ERRNOS = {errno.ENOTDIR, errno.EISDIR, errno.EEXIST, errno.ENAMETOOLONG}
_STORAGE_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT} | _PATH_ERRNOS


def is_storage_error(exc: BaseException) -> bool:
    """A disk-full, read-only or permission error, or a path that cannot be written: the user's to fix, not a bug."""
    return isinstance(exc, OSError) and getattr(exc, "errno", None) in _STORAGE_ERRNOS


def is_user_error(exc: BaseException) -> bool:
    """Errors reported as one line (exit 2). Anything else is a bug: traceback, exit 70, never 1."""
    return isinstance(exc, (KvevalError, FileNotFoundError)) or is_storage_error(exc)


def _described(exc: BaseException) -> str:
    """One line for a user error; a path that cannot be one (through a file, a file where a folder goes) names
    the path and the fix."""
    if isinstance(exc, OSError) and getattr(exc, "errno", None) in _PATH_ERRNOS and exc.filename:
        return f"{exc.filename}: {exc.strerror}; give another path (a folder, or one not made yet)"
    return str(exc)


class _ReaderMayLeave:
    """``sys.stdout`` while a command runs: once its reader has gone (``kveval ... | head``: a closed pipe), what
    the command prints is dropped, as Unix tools do, and the command runs on to its own exit code and files. The
    file descriptor is pointed at ``/dev/null`` so that Python's own flush at exit finds no broken pipe either."""

    def __init__(self, stream):
        # ``None``: started with standard output closed (``kveval gate ... >&-``): nothing can be printed, and the
        # command still runs to its own exit code and files.
        self._stream, self._gone = stream, stream is None

    def write(self, text: str) -> int:
        if not self._gone:
            try:
                return self._stream.write(text)
            except BrokenPipeError:
                self._leave()
        return len(text)

    def flush(self) -> None:
        if not self._gone:
            try:
                self._stream.flush()
            except BrokenPipeError:
                self._leave()

    def _leave(self) -> None:
        self._gone = True
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, self._stream.fileno())
            os.close(devnull)
        except (OSError, ValueError):  # a stream without a file descriptor (a test's capture): nothing to point
            pass

    def __getattr__(self, name):
        if self._stream is None:
            raise AttributeError(f"standard output is closed: it has no {name}")
        return getattr(self._stream, name)


def run_command(command: str, body) -> int:
    """Run ``body()`` and map what it raises to an exit code: the one place that does (the table above). A closed
    stdout stops the printing, not the command (:class:`_ReaderMayLeave`)."""
    stdout = sys.stdout
    sys.stdout = _ReaderMayLeave(stdout)
    try:
        return _run(command, body)
    finally:
        sys.stdout.flush()
        sys.stdout = stdout


def _run(command: str, body) -> int:
    try:
        return int(body() or 0)
    except KeyboardInterrupt:
        print("kveval: interrupted; results written so far are kept", file=sys.stderr)
        return EXIT_INTERRUPTED
    except SystemExit:
        raise
    except Exception as exc:  # noqa: BLE001 - the one place exceptions become exit codes
        if os.environ.get("KVEVAL_DEBUG"):
            raise
        # Only kveval's own errors (and the file system's, for a path the user gave) are the user's to fix: a bare
        # ValueError from a bug must not pass for a user mistake.
        if is_user_error(exc):
            print(f"kveval {command}: error: {_described(exc)}", file=sys.stderr)
            return EXIT_ERROR
        traceback.print_exc()
        print(f"kveval {command}: internal error ({type(exc).__name__}); this is a bug in kveval, "
              f"please report it with the traceback above. Results written so far are kept.", file=sys.stderr)
        return EXIT_INTERNAL


__all__ = [
    "EXIT_CODE_MEANINGS", "EXIT_ERROR", "EXIT_FAIL", "EXIT_INCONCLUSIVE", "EXIT_INTERNAL", "EXIT_INTERRUPTED", "EXIT_OK",
    "EXIT_PASS", "exit_codes_sentence",
    "ConfigError", "KvevalError", "ModelNotFoundError", "PolicyRegistryError", "PolicySpecError", "ResultFileError", "RunFolderError",
    "StorageError", "UnsupportedModelError", "UsageError", "is_storage_error", "is_user_error", "run_command",
]
