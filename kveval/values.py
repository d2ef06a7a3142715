"""What a value from a user (a YAML file, a spec, a keyword argument, a result file) must be to count as a number.

Python counts ``True`` as the integer 1 and ``2.5`` is no count of anything; a
user's ``true`` or ``2.5`` where a count goes is refused, never coerced, by
every reader in kveval. The readers keep their own messages (each names its key
and its fix) and error types; these two predicates are the rule they share.
"""

from __future__ import annotations

import math


def is_whole(value) -> bool:
    """An ``int`` and not a ``bool``: a count, a seed, a number of tokens."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value) -> bool:
    """A finite ``int`` or ``float`` and not a ``bool``: a fraction, a margin, a score (NaN, infinities and
    integers past a float's range, such as a YAML literal of 400 digits, refused)."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return False
    try:
        return math.isfinite(value)
    except OverflowError:  # an int too large for a float
        return False


__all__ = ["is_real", "is_whole"]
