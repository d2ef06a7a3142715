"""Load a causal LM with kveval's attention, ready for :class:`kveval.cache.compressed.compressed.CompressedCache`, and refuse what kveval cannot evaluate exactly."""

from __future__ import annotations

from pathlib import Path

from kveval.cache.attention import ATTENTION_NAME, register_attention
from kveval.cache.exactness import self_check as run_self_check
from kveval.dtypes import checkpoint_kv_dtype, default_kv_dtype
from kveval.errors import ModelNotFoundError, UsageError
from kveval.modeling.architectures import check_mla_modules, check_supported
from kveval.modeling.sources import (
    DEFAULT_MODEL,
    EMBEDDED,
    _dequantized_cache,
    _save_atomically,
    _source,
    load_tokenizer,
    parse_max_memory,
    resolve_device_dtype,
)


def load_model(name: str = DEFAULT_MODEL, device: str = "auto", dtype: str = "auto",
               trust_remote_code: bool = False, self_check: bool = True, device_map=None, max_memory=None, **kwargs):
    """Load a causal LM and its tokenizer, ready for :class:`kveval.cache.compressed.CompressedCache`.

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
        (:mod:`kveval.cache.exactness`). Architectures kveval cannot cache exactly
        (unknown cache layer types) are refused whatever this says.
    **kwargs
        Passed on to ``from_pretrained``.

    Returns
    -------
    (model, tokenizer)
        The model is in eval mode and uses the ``"kveval"`` attention function,
        which is plain SDPA unless a :class:`~kveval.cache.compressed.CompressedCache` is used.
        ``model.kveval_kv_dtype`` records the cache dtype a deployment uses (the
        checkpoint's dtype when it is a 16-bit float, else bfloat16; embedded
        GGUF models: bfloat16, the dtype of their original checkpoints), read
        before the weights are loaded in ``dtype``.
    """
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM


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
    kv_dtype = default_kv_dtype()  # GGUF files keep no checkpoint dtype; their originals are bfloat16
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
    model.kveval_tokenizer = tokenizer  # calibrations read their text with it (kveval.calibration.kv.tokenize_for)
    _check_architecture(model, name, self_check)
    model.kveval_kv_dtype = kv_dtype
    return model, tokenizer


def _check_architecture(model, name: str, self_check: bool) -> None:
    """Refuse what kveval cannot evaluate exactly (the embedded models are covered by the tests instead of a probe)."""
    check_supported(model.config)
    check_mla_modules(model)
    if self_check and name not in EMBEDDED:
        run_self_check(model)


