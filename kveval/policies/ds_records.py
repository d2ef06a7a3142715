"""DeepSeek's own cache packed into a serving engine's per-token records: which record codes each part, what it
costs, and where it cannot apply. Torch-free (the planner reads it); the codecs are
:mod:`kveval.tensors.ds_records`, the stores :mod:`kveval.stores.records`.

Two users: vLLM's ``--kv-cache-dtype fp8_ds_mla|nvfp4_ds_mla`` (:class:`~kveval.policies.vllm.VllmPolicy`) and
V4.1's storage recipe on V4's parts (:class:`~kveval.policies.deepseek_v41.DeepseekV41StoragePolicy`). Each is a
:class:`DeepSeekRecords`: a codec for the latent and its RoPE key (V3.2's store part: K the latent, V the RoPE key),
for V4's K=V window (its store part, values of width 0), for V4's compressed CSA/HCA entries and for the DSA
indexer's keys, and the cache kinds (:class:`~kveval.policies.compatibility.CacheShape`) it applies to; on any
other cache it is refused in one line before the weights load (:meth:`DeepSeekRecords.check_cache`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kveval.errors import UnsupportedModelError
from kveval.policies.base import PlannedCoding
from kveval.tensors import ds_records as codecs

#: vLLM's packed DeepSeek dtypes (``vllm/config/cache.py``).
DS_MLA_DTYPES = ("fp8_ds_mla", "nvfp4_ds_mla")
#: The shapes vLLM's records are written for: the latent and RoPE key of V3.2 (``kernels.py``: "ds_mla layouts
#: require kv_lora_rank == 512"), V4's entries (448 NoPE + 64 RoPE) and the indexer's 128-wide keys.
LATENT, ROPE, ENTRY, INDEXER = 512, 64, 512, 128


@dataclass(frozen=True)
class DeepSeekRecords:
    """The records one setting writes, by part; ``None``: the setting has none for that cache kind.

    ``latent``/``rope``: V3.2's latent and its RoPE key; ``window``: V4's K=V window entries; ``compressed``: V4's
    CSA/HCA entries; ``indexer``: the DSA indexer's keys (V3.2 and V4's CSA layers: ``v32_indexer``/``v4_indexer``).
    ``refusals``: cache kind -> why the setting does not apply to it (a line completed by the model's name).
    ``widths``: whether the record is written for the exact widths vLLM's kernels take (:data:`LATENT`, ...)
    rather than any whole number of blocks."""

    name: str
    latent: object = None
    rope: object = None
    window: object = None
    compressed: object = None
    v32_indexer: object = None
    v4_indexer: object = None
    refusals: tuple[tuple[str, str], ...] = ()
    exact_widths: bool = True

    # --- where it applies ------------------------------------------------------------------------------------------
    def check_cache(self, spec: str, shape) -> None:
        """Refuse, in one line, a cache ``shape`` (:class:`~kveval.policies.compatibility.CacheShape`) these
        records do not code: a kind it has no record for, or widths other than those its kernels are written for."""
        why = dict(self.refusals).get(shape.kind)
        if why is not None:
            raise UnsupportedModelError(f"{spec}: {why.format(model=shape.model)}")
        if self.exact_widths:
            wanted = ({"width": ENTRY, "rope": ROPE, "indexer": INDEXER} if shape.kind == "v4" else
                      {"width": LATENT, "rope": ROPE, "indexer": INDEXER})
            have = {"width": shape.width, "rope": shape.rope, "indexer": shape.indexer}
            if have != wanted:
                names = ("entry", "RoPE dims", "indexer key") if shape.kind == "v4" else ("latent", "RoPE key",
                                                                                         "indexer key")
                said = ", ".join(f"{n} {have[k]}" for n, k in zip(names, wanted))
                need = ", ".join(f"{n} {wanted[k]}" for n, k in zip(names, wanted))
                raise UnsupportedModelError(f"{spec}: the engine's record is written for a {need} per token; "
                                            f"{shape.model} has {said}")
            return
        for what, width, block in (("entry", shape.width, 32), ("indexer key", shape.indexer, 32)):
            if width % block:
                raise UnsupportedModelError(f"{spec}: codes blocks of {block} values; {shape.model}'s {what} of "
                                            f"{width} is not a whole number of them")

    # --- the codecs ------------------------------------------------------------------------------------------------
    def part_codec(self, part: str, v4: bool):
        """The codec of ``part`` (``latent``, ``window``, ``csa``, ``hca``, ``indexer``) of a V3.2 (``v4`` false)
        or V4 cache."""
        if part == "indexer":
            return self.v4_indexer if v4 else self.v32_indexer
        if part == "latent":
            return self.latent
        if part == "window":
            return self.window
        return self.compressed

    def store_codecs(self, key_dim: int, value_dim: int) -> tuple:
        """The codecs of the store part's K and V: V4's K=V window where values have width 0, else V3.2's latent
        and its RoPE key."""
        if value_dim == 0:
            return self.window, codecs.Empty()
        return self.latent, self.rope

    def engine_codec(self, key_dim: int, value_dim: int):
        """:meth:`store_codecs` as the engine store takes them."""
        from kveval.stores.engine import EngineCodec

        return EngineCodec(*self.store_codecs(key_dim, value_dim))

    # --- bytes -----------------------------------------------------------------------------------------------------
    def token_bytes(self, key_dim: int, value_dim: int, itemsize: int) -> tuple[int, int]:
        """Bytes ``(K, V)`` of one token of the store part (the record splits into the latent's bytes and the RoPE
        key's; a V4 window entry is all K)."""
        key, value = self.store_codecs(key_dim, value_dim)
        return key.row_bytes(key_dim), value.row_bytes(value_dim)

    def planned_coding(self) -> PlannedCoding:
        return PlannedCoding(token_bytes=self.token_bytes, label=self.name)

    def planned_part_coding(self, part: str, width: int) -> PlannedCoding | None:
        """A part of keys alone, sized as its record: V4's window (``window``), CSA/HCA entries and the indexer's
        keys (V3.2's latent is the store part, sized by :meth:`planned_coding`). V3.2's and V4's FP8 indexer
        records differ in rounding only, not in bytes, so the indexer is sized by whichever this setting has."""
        if part == "latent":
            return None
        codec = self.part_codec(part, v4=self.v32_indexer is None)
        size = codec.row_bytes(width)
        return PlannedCoding(token_bytes=lambda key_dim, value_dim, itemsize: (size, 0), label=f"{self.name}:{size}B")

    def sequence(self, part: str, width: int, v4: bool):
        """One row of ``part`` coded as its record (:class:`~kveval.stores.records.RecordSequence`)."""
        from kveval.stores.records import RecordSequence

        return RecordSequence(self.part_codec(part, v4))


_PER_HEAD = ("heads", "packs DeepSeek's MLA latent or V4's entries into vLLM's per-token record; {model} caches "
                      "per-head K/V, which vLLM codes with per-tensor FP8: use vllm(kv_cache_dtype=fp8)")
_DENSE_MLA = ("mla", "vLLM 0.33 serves the packed DeepSeek records on its sparse MLA backends only (FLASHMLA_SPARSE, "
                     "FLASHINFER_MLA_SPARSE: DeepSeek V3.2, V4); {model}'s dense MLA backends (FlashMLA, CUTLASS MLA, "
                     "Triton MLA) take fp8: use vllm(kv_cache_dtype=fp8)")

#: ``--kv-cache-dtype fp8_ds_mla``: V3.2's 656-byte record (``vllm/v1/attention/backends/mla/flashmla_sparse.py``'s
#: layout note; ``mla_attention.py``: ``state_content_bytes={"fp8_ds_mla": 656, ...}``) and V4's 584-byte one
#: (``vllm/models/deepseek_v4/attention.py``: ``state_content_bytes=584``), the same record for V4's window and
#: compressed entries; the indexer's keys in vLLM's default FP8 indexer cache (132 bytes).
FP8_DS_MLA = DeepSeekRecords(
    "fp8_ds_mla", latent=codecs.V32_FP8_LATENT, rope=codecs.Bfloat16Values(), window=codecs.V4_ENTRY,
    compressed=codecs.V4_ENTRY, v32_indexer=codecs.V32_INDEXER, v4_indexer=codecs.V4_INDEXER,
    refusals=(_PER_HEAD, _DENSE_MLA))
#: ``--kv-cache-dtype nvfp4_ds_mla`` (SM100): V3.2's 352-byte record. On DeepSeek V4 vLLM 0.33 refuses it:
#: ``vllm/models/deepseek_v4/attention.py`` ``_resolve_dsv4_kv_cache_dtype`` takes fp8 kv-cache dtypes only (V4.1's
#: model, ``vllm/models/deepseek_v41``, is the one with an NVFP4 compressed record).
NVFP4_DS_MLA = DeepSeekRecords(
    "nvfp4_ds_mla", latent=codecs.V32_NVFP4_LATENT, rope=codecs.E4m3Values(), v32_indexer=codecs.V32_INDEXER,
    refusals=(_PER_HEAD, _DENSE_MLA,
              ("v4", "vLLM 0.33 packs DeepSeek V4's cache in fp8_ds_mla only (vllm/models/deepseek_v4/attention.py "
                     "_resolve_dsv4_kv_cache_dtype); NVFP4 entries are V4.1's: use vllm(kv_cache_dtype=fp8_ds_mla) "
                     "or deepseek_v41_storage")))
#: V4.1's storage recipe on V4's parts (vLLM 0.33's ``vllm/models/deepseek_v41``, ``--kv-cache-dtype
#: nvfp4_ds_mla`` on SM100): the window MXFP8 (528 B), the compressed entries NVFP4 (288 B), the indexer MXFP4 (68 B).
V41_STORAGE = DeepSeekRecords(
    "v41", window=codecs.V41_WINDOW, compressed=codecs.V41_ENTRY, v4_indexer=codecs.V41_INDEXER,
    exact_widths=False,
    refusals=tuple((kind, "codes DeepSeek V4's parts (window, CSA/HCA entries, indexer keys) as V4.1 stores them; "
                          "{model} has none of them") for kind in ("heads", "mla", "indexed_mla")))

#: ``fp8_ds_mla`` with ``--attention-config '{"indexer_kv_dtype": "mxfp4"}'`` (``v1/attention/backends/mla/indexer.py``
#: ``dsa_indexer_uses_fp4``): V4's indexer keys in MXFP4, 68 bytes, as DeepSeek serves V4. kveval pins that cache to
#: V4's writer alone, so it is refused on V3.2.
FP8_DS_MLA_MXFP4_INDEXER = DeepSeekRecords(
    "fp8_ds_mla", window=codecs.V4_ENTRY, compressed=codecs.V4_ENTRY, v4_indexer=codecs.V4_MXFP4_INDEXER,
    refusals=(_PER_HEAD, _DENSE_MLA,
              ("indexed_mla", "indexer_kv_dtype=mxfp4 is pinned here to DeepSeek V4's MXFP4 indexer writer "
                              "(_fused_kv_compress_norm_rope_insert_indexer_mxfp4_attn); on {model} use "
                              "indexer_kv_dtype=fp8")))
#: vLLM's ``indexer_kv_dtype`` values (``DSA_INDEXER_KV_DTYPES``).
INDEXER_KV_DTYPES = ("fp8", "mxfp4")
RECORDS = {("fp8_ds_mla", "fp8"): FP8_DS_MLA, ("nvfp4_ds_mla", "fp8"): NVFP4_DS_MLA,
           ("fp8_ds_mla", "mxfp4"): FP8_DS_MLA_MXFP4_INDEXER}

__all__ = ["DS_MLA_DTYPES", "DeepSeekRecords", "FP8_DS_MLA", "FP8_DS_MLA_MXFP4_INDEXER", "INDEXER_KV_DTYPES",
           "NVFP4_DS_MLA", "RECORDS", "V41_STORAGE"]
