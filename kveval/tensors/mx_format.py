"""Block-scaled floating-point formats (NVFP4, MXFP4, MXFP8, ...) as data, torch-free: element codings, block sizes,
scale codings and the bytes they store. The memory planner and the policies' checks size codes from here without a
model; :mod:`kveval.tensors.microscaling` codes tensors in them (bit for bit as torchao 0.18 does) and re-exports
every name below.
"""

from __future__ import annotations

from dataclasses import dataclass

from kveval.errors import UsageError

E2M1_MAX = 6.0
E4M3_MAX = 448.0
#: The block axes of a K/V tensor ``[H, T, D]``: channels within a token, or tokens within a channel.
AXES = ("token", "channel")


@dataclass(frozen=True)
class ElementCoding:
    """One element type: its name, bits per value, largest finite value, and the exponent of that value's power of
    two (``emax_elem`` of OCP MX, torchao's ``*_MAX_POW2``)."""

    name: str
    bits: int
    largest: float
    largest_pow2: int


E2M1 = ElementCoding("e2m1", 4, E2M1_MAX, 2)
E4M3 = ElementCoding("e4m3", 8, E4M3_MAX, 8)


@dataclass(frozen=True)
class MicroscalingFormat:
    """A block-scaled format: element coding, values per block, scale coding (``e4m3`` or ``ue8m0``), and whether
    it has a per-tensor FP32 global scale (NVFP4's second level)."""

    name: str
    element: ElementCoding
    block: int
    scale: str
    global_scale: bool = False

    def row_bytes(self, dim: int) -> int:
        """Bytes stored for one row of ``dim`` values: codes and one-byte block scales (global scales apart)."""
        self.check_length(dim)
        return dim * self.element.bits // 8 + dim // self.block

    def check_length(self, length: int) -> None:
        """Refuse a row that is not a whole number of blocks, as torchao and vLLM do (neither pads)."""
        if length % self.block:
            raise UsageError(f"{self.name} codes blocks of {self.block} values; a row of {length} is not a whole "
                             f"number of blocks (the engines refuse it rather than pad)")


NVFP4 = MicroscalingFormat("nvfp4", E2M1, 16, "e4m3", global_scale=True)
MXFP4 = MicroscalingFormat("mxfp4", E2M1, 32, "ue8m0")
MXFP8 = MicroscalingFormat("mxfp8", E4M3, 32, "ue8m0")
#: fouroversix's adaptive NVFP4 (vLLM's ``nvfp4_4over6``): coded only by :func:`encode_nvfp4_4over6`.
NVFP4_4OVER6 = MicroscalingFormat("nvfp4_4over6", E2M1, 16, "e4m3", global_scale=True)
#: fouroversix's E4M3 ceiling for block scales, leaving room for the x1.5 of a block scaled to its max / 4.
FOUROVERSIX_SCALE_MAX = 256.0
#: SGLang's ``fp4_mx_block16``: coded only by :func:`encode_sglang_fp4_mx_block16` (its own rounding and scale rule).
FP4_MX_BLOCK16 = MicroscalingFormat("fp4_mx_block16", E2M1, 16, "ue8m0")
FORMATS = {f.name: f for f in (NVFP4, MXFP4, MXFP8)}
#: Bytes of one FP32 global scale.
GLOBAL_SCALE_BYTES = 4


def bytes_per_token_head(fmt: MicroscalingFormat, head_dim: int, axis: str = "token") -> float:
    """Bytes one token of one head stores, codes and block scales (per-tensor global scales apart): the same along
    either axis, since a block of ``block`` values has one scale whichever way it runs (along tokens, a whole
    block of tokens holds ``head_dim`` scales). Along tokens (``axis="token"``) the head dimension must be whole
    blocks; along channels any head dimension is (the tokens are blocked)."""
    if axis == "token":
        fmt.check_length(head_dim)
    elif axis not in AXES:
        raise UsageError(f"unknown block axis {axis!r} (one of {', '.join(AXES)})")
    return head_dim * fmt.element.bits / 8 + head_dim / fmt.block
