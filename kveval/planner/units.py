"""The memory planner's numbers from text and back: sizes (``80GiB``), token counts (``8k``), headroom, counts and
element widths checked, and bytes for people (``1.5 GiB``)."""

from __future__ import annotations

import argparse
import math
import re

from kveval.errors import UsageError
from kveval.values import is_real, is_whole


def check_int(value, what: str, minimum: int) -> int:
    """``value`` when it is a whole number of at least ``minimum``; else ``ValueError`` (one line) naming ``what``."""
    if not is_whole(value):
        raise UsageError(f"{what}={value!r} must be an integer")
    if value < minimum:
        raise UsageError(f"{what}={value} must be >= {minimum}")
    return value


def check_dtype_bytes(dtype_bytes) -> int:
    if not is_whole(dtype_bytes) or dtype_bytes not in (1, 2, 4, 8):
        raise UsageError(f"dtype_bytes={dtype_bytes!r} must be 1, 2 (fp16/bf16), 4 (fp32) or 8")
    return dtype_bytes


_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_size(text, what: str = "size") -> int:
    """Bytes from ``80GiB``, ``16GB``, ``1.5TiB`` or a plain number of bytes (GB = 10^9, GiB = 2^30)."""
    if is_real(text):
        value = float(text)
    else:
        match = _SIZE.match(str(text))
        if not match or match.group(2).lower() not in _UNITS:
            raise UsageError(f"{what}={text!r} is not a size; write e.g. 80GiB, 16GB, 512MiB or a number of bytes")
        value = float(match.group(1)) * _UNITS[match.group(2).lower()]
    if not value > 0 or not math.isfinite(value):
        raise UsageError(f"{what}={text!r} must be a positive size")
    return int(value)


def parse_tokens(text, what: str = "context") -> int:
    """Tokens from ``8192``, ``8k`` (8192) or ``1m`` (1048576): kveval's own grammar (k and K alike are 1,024;
    vLLM's is :func:`parse_vllm_int`)."""
    if is_whole(text):
        return text
    match = re.match(r"^\s*(-?[0-9]*\.?[0-9]+)\s*([kKmM]?)\s*$", str(text))
    if not match:
        raise UsageError(f"{what}={text!r} is not a token count; write e.g. 8192 or 8k")
    value = float(match.group(1)) * {"": 1, "k": 1024, "m": 1024**2}[match.group(2).lower()]
    if value != int(value):
        raise UsageError(f"{what}={text!r} is not a whole number of tokens")
    return int(value)


def token_count_arg(what: str):
    """An ``argparse`` type reading a token count the way :func:`parse_tokens` does (``8192``, ``8k``, ``1m``), so
    that every command reads sizes by one grammar; a bad one is argparse's one-line error (exit 2)."""
    def parse(text: str) -> int:
        try:
            return parse_tokens(text, what)
        except UsageError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = "token count"  # argparse names the type in its message
    return parse


#: vLLM's human-readable integers (``vllm/utils/argparse_utils.py``, ``human_readable_int``, vLLM 0.33): a
#: lower-case suffix is decimal, an upper-case one binary.
_VLLM_INT = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_VLLM_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_VLLM_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def parse_vllm_int(text, what: str = "max_model_len") -> int:
    """Tokens as vLLM 0.33 reads ``--max-model-len`` (``vllm/utils/argparse_utils.py``: ``human_readable_int_or_auto``
    and ``human_readable_int``): ``32k`` is 32,000 and ``25.6k`` 25,600 (k, m, g, t: powers of 1,000, decimals
    allowed), ``32K`` is 32,768 (K, M, G, T: powers of 1,024, whole numbers only), else a plain integer. vLLM's
    ``auto`` (-1: the longest that fits) is refused: the planner answers for a given length."""
    if is_whole(text):
        return text
    value = str(text).strip()
    if value == "-1" or value.lower() == "auto":
        raise UsageError(f"{what}={text!r}: vLLM's auto picks the longest length that fits at start-up; give the "
                         f"length to plan, e.g. 32k (32,000) or 32K (32,768)")
    match = _VLLM_INT.fullmatch(value)
    if match:
        number, suffix = match.groups()
        if suffix in _VLLM_DECIMAL:
            return int(float(number) * _VLLM_DECIMAL[suffix])
        if "." in number:
            raise UsageError(f"{what}={text!r}: vLLM allows no decimals with binary suffixes like {suffix}; did you "
                             f"mean {number}{suffix.lower()}?")
        return int(number) * _VLLM_BINARY[suffix]
    try:
        return int(value)
    except ValueError:
        raise UsageError(f"{what}={text!r} is not a length vLLM reads; write e.g. 32000, 32k (32,000) or 32K "
                         f"(32,768)") from None


def parse_headroom(value) -> float:
    """A fraction ``0 <= h < 1`` from ``0.1`` or ``"10%"``."""
    text = str(value).strip()
    try:
        h = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise UsageError(f"headroom={value!r} is not a number; give a fraction such as 0.1 or a percentage such as 10%") from None
    if not 0 <= h < 1:
        raise UsageError(f"headroom={value!r} is out of range; give a fraction 0 <= headroom < 1 (e.g. 0.1) or a percentage (10%)")
    return h


def human_bytes(n: float) -> str:
    """``512 KiB``, ``1.5 GiB``: binary units, at most two decimals."""
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            text = f"{n:.2f}".rstrip("0").rstrip(".")
            return f"{text} {unit}"
        n /= 1024
    raise AssertionError


__all__ = ["check_dtype_bytes", "check_int", "human_bytes", "parse_headroom", "parse_size", "parse_tokens",
           "parse_vllm_int"]
