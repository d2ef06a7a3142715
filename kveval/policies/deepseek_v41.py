"""DeepSeek V4.1's storage recipe on V4's parts (``deepseek_v41_storage``): what V4.1's precision choices would cost V4.

V4.1 keeps V4's parts (a sliding window of K=V entries, CSA/HCA compressed entries, the CSA indexer's keys) but
stores them in fewer bits. The field notes took the figures from secondary summaries of V4.1's tech report
(*unverified* there): compressed entries in FP4 (E2M1 with an E4M3 scale per 16, quantized after RoPE), the window
in FP8 (a UE8M0 scale per 32), the indexer keys in FP4 (a UE8M0 scale per 32). vLLM 0.33.0's V4.1 model writes
exactly those records, which is what this policy reproduces (:mod:`kveval.tensors.ds_records`):

* the window: MXFP8, all 512 dims (the RoPE dims too) in e4m3 with a UE8M0 scale per 32: 528 bytes an entry
  (``vllm/models/deepseek_v41/common/ops/fused_compress_quant_cache.py`` ``_rope_quant_insert_mxfp8_kernel``; vLLM
  writes it on SM100, its other GPUs keep V4's 584-byte record);
* the CSA/HCA entries: NVFP4 without a per-tensor scale, E2M1 with an e4m3 scale per 16, after RoPE: 288 bytes
  (``_rope_quant_insert_nvfp4_kernel``; ``--kv-cache-dtype nvfp4_ds_mla``);
* the indexer's keys: MXFP4, E2M1 with a UE8M0 scale per 32: 68 bytes for 128 dims
  (``vllm/models/deepseek_v41/common/ops/indexer_k_store.py``; ``indexer_kv_dtype=mxfp4``).

What is assumed: that V4.1's checkpoint is served this way (vLLM's code is the evidence, V4.1's report is not read
here), and that V4's parts take V4.1's formats unchanged; V4.1's other savings (layers reusing another layer's
compressed KV and indexer) are not part of this recipe. Each part is coded on arrival, as the engine writes it;
the widths must be whole numbers of blocks of 32 (the entries and the indexer keys). Refused on every model but
DeepSeek V4.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from kveval.errors import PolicySpecError
from kveval.policies.base import Placement, PlannedCoding, QuantizationPolicy
from kveval.policies.ds_records import V41_STORAGE


@dataclass
class DeepseekV41StoragePolicy(QuantizationPolicy):
    """V4.1's storage recipe on DeepSeek V4's parts: window MXFP8, compressed entries NVFP4, indexer keys MXFP4
    (see the module doc for the records and what is assumed). No parameters."""

    name = "deepseek_v41_storage"
    description = ("DeepSeek V4.1's storage on V4's parts: window MXFP8, CSA/HCA entries NVFP4 after RoPE, indexer "
                   "MXFP4 (vLLM 0.33's V4.1 records)")
    codes_on_arrival: ClassVar[bool] = True
    records = V41_STORAGE

    def supports(self, placement: Placement) -> bool:
        """V4's parts (:attr:`Placement.PARTS`), declared per object rather than in :attr:`placements`, so that the
        refusals naming the quantizers for V3.2's parts do not name it (:meth:`check_cache` refuses it there)."""
        return placement is Placement.PARTS

    def check_head_dim(self, head_dim: int) -> None:
        """The widths are checked against the cache's shape (:meth:`check_cache`)."""

    def fit_widths(self, widths: dict[str, int], label: str) -> None:
        if label != "head_dim":
            raise PolicySpecError(f"{self.spec()}: codes V4's parts, not a structure's {label} coefficients; "
                                  f"drop the structure policy")

    def check_cache(self, shape) -> None:
        self.records.check_cache(self.spec(), shape)

    def planned_coding(self) -> PlannedCoding:
        return self.records.planned_coding()

    def planned_part_coding(self, part: str, width: int) -> PlannedCoding | None:
        return self.records.planned_part_coding(part, width)

    def part_codes(self, model, layer_idx: int, part: str, width: int, kv_dtype, stride: int):
        return self.records.sequence(part, width, v4=True)

    def make_store(self, inner, model, layer_idx: int):
        from kveval.stores.records import RecordStore

        return RecordStore(self.records.engine_codec, inner.compute_dtype)


__all__ = ["DeepseekV41StoragePolicy"]
