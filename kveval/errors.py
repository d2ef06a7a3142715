"""The one error hierarchy of kveval, and the exit codes it maps to.

Every error a user can cause (a bad spec, config, path, result file or model)
is a :class:`KvevalError` subclass with a one-line message that names the fix.
The command line (:mod:`kveval.cli`) maps exceptions to exit codes here, in one
place:

====  ==========================================================================
0     success; for ``gate``: PASS (non-inferiority shown within the margin)
1     ``gate`` FAIL only: a loss larger than the margin, or a regression rule
      fired with statistical support. Nothing else ever exits 1.
2     an error: bad input, a missing or corrupt file, a full or read-only disk,
      or an unexpected exception (a bug, printed with its traceback)
3     ``gate`` INCONCLUSIVE: too few items to show either PASS or FAIL
130   interrupted (Ctrl-C); results written so far are kept
====  ==========================================================================
"""

from __future__ import annotations

import errno

EXIT_OK = 0
EXIT_PASS = 0
EXIT_FAIL = 1
EXIT_ERROR = 2
EXIT_INCONCLUSIVE = 3
EXIT_INTERRUPTED = 130


class KvevalError(Exception):
    """Base of every error kveval reports to the user as one line (exit 2)."""

    exit_code = EXIT_ERROR


class UsageError(KvevalError, ValueError):
    """Bad input: an argument, a config file, a spec. Also a ``ValueError`` for library callers."""


class PolicySpecError(UsageError):
    """A policy spec that does not parse or validate (unknown name, wrong type, out of range)."""


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


_STORAGE_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT}


def is_storage_error(exc: BaseException) -> bool:
    """A disk-full, read-only or permission error: the user's to fix, not a bug."""
    return isinstance(exc, OSError) and getattr(exc, "errno", None) in _STORAGE_ERRNOS


def is_user_error(exc: BaseException) -> bool:
    """Errors reported as one line (exit 2). Anything else is a bug: traceback, still exit 2, never 1."""
    return isinstance(exc, (KvevalError, FileNotFoundError)) or is_storage_error(exc)


__all__ = [
    "EXIT_ERROR", "EXIT_FAIL", "EXIT_INCONCLUSIVE", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_PASS",
    "ConfigError", "KvevalError", "ModelNotFoundError", "PolicySpecError", "ResultFileError", "RunFolderError",
    "StorageError", "UnsupportedModelError", "UsageError", "is_storage_error", "is_user_error",
]
