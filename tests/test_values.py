"""The rule every reader of user input shares for numbers (kveval/values.py): a bool is no number, a float no count,
and a fraction or margin is finite."""

import math

import pytest

from kveval.values import is_real, is_whole


@pytest.mark.parametrize("value, whole, real", [
    (3, True, True), (0, True, True), (-2, True, True),
    (True, False, False), (False, False, False),  # Python's 1 and 0, never a user's count or fraction
    (2.0, False, True), (0.5, False, True),
    (math.inf, False, False), (-math.inf, False, False), (math.nan, False, False),
    (10**400, True, False),  # a YAML or JSON literal of 400 digits: math.isfinite raised OverflowError
    ("3", False, False), (None, False, False), ([3], False, False),
])
def test_what_counts_as_a_whole_or_real_number(value, whole, real):
    assert (is_whole(value), is_real(value)) == (whole, real)
