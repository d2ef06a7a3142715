"""A ``.gguf`` file as the memory planner sees it: the attention shape its metadata records and its weights at the
size its tensors are stored in (llama.cpp's quantized blocks, scales included), read with the ``gguf`` package's
format constants. No tensor data is read.

The header is parsed here rather than with ``gguf.GGUFReader``, which builds an object per tokenizer entry (1.6 s
for SmolLM2's 49,152 tokens, 8 s for Gemma 3's 262,144); this reader skips the arrays it does not need and keeps
their lengths, and takes well under a second.

What is read (``{arch}`` is ``general.architecture``), as llama.cpp reads it (``src/llama-model.cpp``):

* ``{arch}.block_count`` layers, ``{arch}.attention.head_count`` query heads, ``{arch}.attention.head_count_kv`` K/V
  heads (a per-layer array: a layer with 0 holds no K/V, a Mamba or recurrent layer), ``{arch}.attention.key_length``
  / ``value_length`` (default ``embedding_length / head_count``), ``{arch}.context_length``;
* ``{arch}.attention.sliding_window`` with ``{arch}.attention.sliding_window_pattern`` (a per-layer array, true for
  sliding layers, or ``n``: every ``n``-th layer is full) or, without it, the pattern llama.cpp fixes for the
  architecture (Gemma 2: 2, Gemma 3: 6, gpt-oss: 2, Cohere 2: 4);
* MLA (DeepSeek-V2/V3: ``{arch}.attention.kv_lora_rank`` with ``{arch}.rope.dimension_count``);
* every tensor's type and shape: the weights' bytes as stored and the parameter count.
"""

from __future__ import annotations

import mmap
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType, LlamaFileType

from kveval.errors import UsageError

#: The first bytes of a GGUF file (``gguf.GGUF_MAGIC``, little-endian ``GGUF``).
GGUF_MAGIC = b"GGUF"

#: ``general.architecture`` -> the transformers ``model_type`` whose conventions the planner applies.
GGUF_MODEL_TYPES = {"gemma3": "gemma3_text", "gemma2": "gemma2", "deepseek2": "deepseek_v2", "qwen2moe": "qwen2_moe",
                    "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss"}

#: Sliding-window patterns llama.cpp fixes per architecture when the file records none (``set_swa_pattern``: layer
#: ``i`` slides unless ``i % n == n - 1``).
LLAMACPP_SWA_PATTERNS = {"gemma2": 2, "gemma3": 6, "gpt-oss": 2, "cohere2": 4}

_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GGUFWeights:
    """A GGUF's tensors: ``bytes`` as stored, ``parameters`` (elements) and how many tensors of each type."""

    bytes: int
    parameters: int
    types: dict[str, int]
    file_type: str

    @property
    def describe(self) -> str:
        kinds = ", ".join(f"{n} {t}" for t, n in sorted(self.types.items(), key=lambda kv: (-kv[1], kv[0])))
        bits = 8 * self.bytes / self.parameters if self.parameters else 0.0
        head = f"{self.file_type}: " if self.file_type else ""
        return f"{head}{kinds} tensors; {bits:.2f} bits per parameter"


class _Header:
    """GGUF metadata (scalars and strings; arrays of numbers or booleans; other arrays as their length) and tensor
    infos, read from a memory map."""

    def __init__(self, path: Path):
        self.path = path
        with path.open("rb") as f:
            try:
                self.buf = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except ValueError:  # an empty file
                raise UsageError(f"{path}: not a GGUF file (empty)") from None
        self.pos = 0
        self._layouts: dict[str, struct.Struct] = {}
        if self.buf[:4] != GGUF_MAGIC:
            raise UsageError(f"{path}: not a GGUF file (it does not start with {GGUF_MAGIC!r}); give a .gguf "
                             f"llama.cpp wrote, a config.json, a preset or a Hub id")
        self.order = "<"
        version = struct.unpack_from("<I", self.buf, 4)[0]
        if version & 0xFFFF == 0:  # written big-endian (gguf's own test for it)
            self.order, version = ">", struct.unpack_from(">I", self.buf, 4)[0]
        if version not in (2, 3):
            raise UsageError(f"{path}: GGUF version {version}; the planner reads versions 2 and 3")
        self.pos = 8
        n_tensors, n_kv = self._take("QQ")
        self.fields: dict[str, Any] = {}
        self.lengths: dict[str, int] = {}
        for _ in range(n_kv):
            key = self._string()
            (kind,) = self._take("I")
            self.fields[key] = self._value(kind, key)
        self.tensors: list[tuple[str, int, int]] = []  # name, type, elements
        for _ in range(n_tensors):
            name = self._string()
            (dims,) = self._take("I")
            shape = self._take("Q" * dims)
            (kind,) = self._take("I")
            self._take("Q")  # offset of its data
            elements = 1
            for d in shape:
                elements *= d
            self.tensors.append((name, kind, elements))
        self.buf.close()

    def _take(self, fmt: str) -> tuple:
        layout = self._layouts.get(fmt)
        if layout is None:
            layout = self._layouts[fmt] = struct.Struct(self.order + fmt)
        try:
            values = layout.unpack_from(self.buf, self.pos)
        except struct.error:
            raise UsageError(f"{self.path}: truncated GGUF header (at byte {self.pos:,})") from None
        self.pos += layout.size
        return values

    def _string(self) -> str:
        (n,) = self._take("Q")
        raw = self.buf[self.pos:self.pos + n]
        if len(raw) != n:
            raise UsageError(f"{self.path}: truncated GGUF header (at byte {self.pos:,})")
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def _value(self, kind: int, key: str):
        if kind in _SCALARS:
            return self._take(_SCALARS[kind])[0]
        if kind == _STRING:
            return self._string()
        if kind != _ARRAY:
            raise UsageError(f"{self.path}: {key} has value type {kind}, which GGUF does not define")
        item, count = self._take("IQ")
        self.lengths[key] = count
        if item in _SCALARS:
            fmt = _SCALARS[item]
            if key.startswith("tokenizer."):  # scores, token types, ...: skipped, only their length is kept
                self.pos += count * struct.calcsize("<" + fmt)
                return None
            return list(self._take(fmt * count))
        if item == _STRING:
            for _ in range(count):  # skip: tokens, merges
                (n,) = self._take("Q")
                self.pos += n
            return None
        for _ in range(count):  # arrays of arrays: read and dropped
            self._value(item, key)
        return None


def read_gguf(path: Path) -> tuple[dict[str, Any], GGUFWeights, str]:
    """``(config, weights, architecture)``: a ``config.json``-style dict the planner reads
    (:func:`kveval.planner.model_specs.spec_from_config`), the tensors' stored size, and ``general.architecture``."""
    header = _Header(path)
    fields = header.fields
    arch = fields.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise UsageError(f"{path}: the GGUF records no general.architecture")

    def get(key: str, default=None):
        return fields.get(f"{arch}.{key}", default)

    layers = get("block_count")
    if not isinstance(layers, int) or layers < 1:
        raise UsageError(f"{path}: the GGUF records no {arch}.block_count; is it a language model?")
    heads = get("attention.head_count")
    kv = get("attention.head_count_kv", heads)
    heads_list = heads if isinstance(heads, list) else [heads] * layers
    kv_list = kv if isinstance(kv, list) else [kv] * layers
    if len(heads_list) != layers or len(kv_list) != layers or None in heads_list + kv_list:
        raise UsageError(f"{path}: {arch}.attention.head_count / head_count_kv do not give every one of its {layers} "
                         f"layers a head count")
    attention = [k > 0 for k in kv_list]
    kv_counts = {k for k in kv_list if k > 0}
    if len(kv_counts) != 1:
        raise UsageError(f"{path}: {arch}.attention.head_count_kv differs between layers ({sorted(kv_counts)}); the "
                         f"planner plans one K/V head count: give a config.json instead")
    hidden = get("embedding_length")
    q_heads = max(heads_list)
    key_length = get("attention.key_length")
    value_length = get("attention.value_length", key_length)
    rank = get("attention.kv_lora_rank")
    config: dict[str, Any] = {
        "_name_or_path": path.name, "model_type": GGUF_MODEL_TYPES.get(arch, arch.replace("-", "_")),
        "num_hidden_layers": layers, "num_attention_heads": q_heads, "num_key_value_heads": kv_counts.pop(),
        "hidden_size": hidden, "max_position_embeddings": get("context_length"),
        "vocab_size": get("vocab_size") or header.lengths.get("tokenizer.ggml.tokens"),
    }
    if rank:  # MLA: the latent and the decoupled RoPE key
        config |= {"kv_lora_rank": rank, "qk_rope_head_dim": get("rope.dimension_count") or 0}
    elif key_length is not None:
        if value_length != key_length:
            raise UsageError(f"{path}: K heads of {key_length} and V heads of {value_length}; the planner plans K "
                             f"and V of one head_dim: give a config.json instead")
        swa_length = get("attention.key_length_swa")
        if swa_length is not None and swa_length != key_length:
            raise UsageError(f"{path}: sliding layers' heads of {swa_length} differ from the others' {key_length}; "
                             f"the planner plans one head_dim: give a config.json instead")
        config["head_dim"] = key_length
    if get("expert_count"):
        config["n_routed_experts"] = get("expert_count")
    window = get("attention.sliding_window")
    pattern = get("attention.sliding_window_pattern", LLAMACPP_SWA_PATTERNS.get(arch))
    if window:
        config["sliding_window"] = window
    if isinstance(pattern, list) and len(pattern) != layers:
        raise UsageError(f"{path}: {arch}.attention.sliding_window_pattern has {len(pattern)} entries for "
                         f"{layers} layers")
    if window and pattern is not None:
        sliding = pattern if isinstance(pattern, list) else [i % pattern < pattern - 1 for i in range(layers)]
    else:
        sliding = [bool(window)] * layers
    if not all(attention) or (window and pattern is not None):
        config["layer_types"] = ["mamba" if not a else "sliding_attention" if s else "full_attention"
                                 for a, s in zip(attention, sliding)]
    sizes, types, parameters = 0, Counter(), 0
    for name, kind, elements in header.tensors:
        try:
            quant = GGMLQuantizationType(kind)
            block, size = GGML_QUANT_SIZES[quant]
        except (ValueError, KeyError):
            raise UsageError(f"{path}: tensor {name} has ggml type {kind}, which this gguf package does not know; "
                             f"upgrade it (pip install -U gguf) or give --weights") from None
        sizes += elements // block * size
        parameters += elements
        types[quant.name] += 1
    config["num_parameters"] = parameters
    file_type = fields.get("general.file_type")
    try:
        file_name = LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else ""
    except ValueError:
        file_name = f"file type {file_type}"
    return config, GGUFWeights(sizes, parameters, dict(types), file_name), arch


def is_gguf(path: Path) -> bool:
    """Whether ``path`` is a file named ``.gguf`` or starting with the GGUF magic."""
    if not path.is_file():
        return False
    if path.suffix.lower() == ".gguf":
        return True
    try:
        with path.open("rb") as f:
            return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:
        return False


__all__ = ["GGUFWeights", "GGUF_MODEL_TYPES", "LLAMACPP_SWA_PATTERNS", "is_gguf", "read_gguf"]
