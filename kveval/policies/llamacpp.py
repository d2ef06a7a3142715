"""llama.cpp's ``--cache-type-k`` / ``--cache-type-v`` as the ``llamacpp`` engine preset (the engines' shared contract:
:mod:`kveval.policies.engines`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kveval.errors import PolicySpecError
from kveval.policies.engines import EnginePolicy, check_engine_choice


LLAMACPP_TYPES = ("f32", "f16", "bf16", "q8_0", "q5_1", "q5_0", "q4_1", "q4_0")
#: llama.cpp cache types kveval does not reproduce, and why (one line each).
LLAMACPP_UNPINNED = {"iq4_nl": "the gguf package has no reference quantizer to check it against bit for bit"}


@dataclass
class LlamaCppPolicy(EnginePolicy):
    """llama.cpp's ``--cache-type-k`` / ``--cache-type-v``: ggml blocks of 32 values along each token's head row.

    Follows ``ggml/src/ggml-quants.c`` (``quantize_row_q8_0_ref``, ``quantize_row_q4_0_ref``,
    ``quantize_row_q4_1_ref``, ``quantize_row_q5_0_ref``, ``quantize_row_q5_1_ref`` and the matching
    ``dequantize_row_*``), checked bit for bit against the ``gguf`` package's numpy port (``gguf.quants``).

    Attributes
    ----------
    k, v : str
        Cache types of K and V: ``f16`` (llama.cpp's default), ``bf16``, ``f32``, ``q8_0``, ``q5_1``, ``q5_0``,
        ``q4_1``, ``q4_0``. Block types need a head width that is a multiple of 32, as llama.cpp does.
    quantize_q : bool
        Round Q as ggml's Q.K takes it (default ``true``): converted to the K type's ``vec_dot_type``
        (``q8_0`` for a ``q8_0``/``q4_0``/``q5_0`` K, ``q8_1`` for ``q4_1``/``q5_1``, ``f16``/``bf16`` for those),
        as the CPU flash attention (``ggml/src/ggml-cpu/ops.cpp``, ``q_to_vec_dot``) and ``ggml_mul_mat`` both do;
        ``false``: K/V codes alone.
    cpu : bool
        llama.cpp on an x86 CPU (AVX) build: ``q8_0`` codes (of K, V and Q) as its SIMD ``quantize_row_q8_0`` gives
        them (``id = 127 / amax``, halves rounded to even), not the reference function's (``1 / d``, ``roundf``),
        which CUDA's copy kernels follow. Default ``false``.
    """

    name = "llamacpp"
    serving_engine: ClassVar[str] = "llamacpp"
    description = "llama.cpp cache types (--cache-type-k/-v): q8_0, q5_1, q5_0, q4_1, q4_0, f16, bf16 ggml blocks"
    engine: ClassVar[str] = "llama.cpp"
    follows: ClassVar[str] = "ggml/src/ggml-quants.c quantize_row_<type>_ref / dequantize_row_<type>"
    has_scales: ClassVar[bool] = False
    k: str = "f16"
    v: str = "f16"
    quantize_q: bool = True
    cpu: bool = False

    def __post_init__(self):
        super().__post_init__()
        for key in ("k", "v"):
            check_engine_choice(self.name, key, getattr(self, key), LLAMACPP_TYPES, LLAMACPP_UNPINNED,
                                "a llama.cpp cache type")

    def check_head_dim(self, head_dim: int) -> None:
        for key in ("k", "v"):
            kind = getattr(self, key)
            if kind.startswith("q") and head_dim % 32:
                raise PolicySpecError(f"{self.spec()}: {key}={kind} codes blocks of 32 values and head_dim={head_dim} "
                                      f"is not a multiple of 32 (llama.cpp refuses it too); use f16 or bf16")

    def attended_query(self, query):
        if not self.quantize_q:
            return query
        from kveval.tensors.engine_formats import ggml_query

        return ggml_query(query, self.k, self.cpu)

    def coded_bytes(self, key_dim: int, value_dim: int, kv_itemsize: int) -> tuple[int, int]:
        from kveval.tensors.engine_formats import ggml_row_bytes

        return ggml_row_bytes(self.k, key_dim), ggml_row_bytes(self.v, value_dim)

    def codec(self, model, layer_idx: int):
        from kveval.stores.engine import EngineCodec, GgmlSide

        return EngineCodec(GgmlSide(self.k, self.cpu), GgmlSide(self.v, self.cpu))
