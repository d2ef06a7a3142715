"""What one run compresses and how: a policy stack, a mode and a KV dtype, parsed once at the edge.

Users write a run as a policy spec, optionally with a mode suffix
(``snapkv(ratio=0.5)@query`` in a sweep config), plus ``--mode`` and
``--kv-dtype`` on the command line, ``mode:`` and ``kv_dtype:`` in a sweep
config, or ``compress=`` and ``kv_dtype=`` in lm-eval model args. Each of those
edges calls :meth:`RunSpec.parse` once; everything below them receives the
typed :class:`RunSpec` and never parses a string again. A finished run's policy, recorded in ``run.json`` as
its spec, is read back once by :func:`recorded_policy` where the engine side loads the run (finalizing it, the
deployment decision).

:meth:`RunSpec.for_model` checks the spec against the model's ``config.json``
(cheap: no weights) so that an error known from spec and config is reported
before the model loads, and adapts unset quantization groups to the model's
head width.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from kveval.policies.compatibility import (
    cache_shape,
    check_cache,
    check_policy,
    refuse_indexer_term,
    refuse_model_indexer,
)
from kveval.dtypes import dtype_name, parse_kv_dtype
from kveval.errors import PolicySpecError, UnsupportedModelError, UsageError
from kveval.modeling.layer_types import NATIVE_MODEL_TYPES
from kveval.modeling.sources import EMBEDDED
from kveval.planner.layouts import merged_layers, reading_layers
from kveval.planner.model_specs import load_model_spec
from kveval.policies.base import PolicyStack
from kveval.policies.spec import parse_policy

if TYPE_CHECKING:
    import torch

MODES = ("context", "query")


def check_mode(policy: "PolicyStack | None", mode: str) -> None:
    """Refuse a query-agnostic reconstruction (KVzip) in ``query`` mode, where the question would sit between the
    context and the tokens that repeat it (one line)."""
    selection = policy.selection if policy is not None else None  # policy None: the baseline
    if mode == "query" and selection is not None and selection.reconstructs:
        raise UsageError(f"{policy.spec}: KVzip reconstructs the context before any question is seen; "
                         f"run it in mode 'context' (--mode context)")


def parse_mode(mode: str | None, default: str = "context") -> str:
    """``context`` or ``query`` (``None``: ``default``); anything else is a :class:`UsageError`."""
    if mode is None or mode == "":
        return default
    if mode not in MODES:
        raise UsageError(f"mode={mode!r}; use context (compress before the question is seen) or query (with it)")
    return mode


@dataclass(frozen=True)
class RunSpec:
    """A policy stack, the compression mode and the KV dtype of one run.

    Attributes
    ----------
    policy : PolicyStack
        The validated policy stack (``PolicyStack()`` is the baseline ``none``).
    mode : str
        ``"context"`` (compress before the question is seen) or ``"query"``.
    kv_dtype : torch.dtype or None
        Dtype of the full-precision tokens the cache holds and of the bytes
        ratios are stated against: ``torch.bfloat16``, ``torch.float16`` or
        ``torch.float32``; ``None`` is the model's deployment dtype.
    """

    policy: PolicyStack
    mode: str = "context"
    kv_dtype: "torch.dtype | None" = None

    def __post_init__(self):
        check_mode(self.policy, self.mode)  # KVzip reconstructs the context before any question: context mode only

    @classmethod
    def parse(cls, policy: "str | PolicyStack | None", mode: str | None = None, kv_dtype=None,
              default_mode: str = "context") -> "RunSpec":
        """Parse a policy spec with an optional ``@context``/``@query`` suffix.

        ``mode`` (e.g. ``--mode``) applies when the spec has no suffix; a suffix
        that contradicts an explicit ``mode`` is an error. Raises
        :class:`PolicySpecError` or :class:`UsageError`, one line each.
        """
        if isinstance(policy, str) and "@" in policy:
            text, *suffixes = policy.split("@")
            for suffix in (x.strip() for x in suffixes):
                if suffix.startswith("kv_dtype="):
                    kv_dtype = suffix[len("kv_dtype="):]
                    continue
                if suffix not in MODES:
                    raise PolicySpecError(f"policy {policy!r}: the suffix after '@' is a mode, context or query")
                if mode is not None and mode != suffix:
                    raise UsageError(f"policy {policy!r} says mode {suffix} but mode={mode} was also given; give one")
                mode = suffix
            policy = text
        stack = parse_policy(policy)
        return cls(stack, parse_mode(mode, default_mode), parse_kv_dtype(kv_dtype))

    @property
    def spec(self) -> str:
        """The canonical policy spec (``none`` for the baseline)."""
        return self.policy.spec

    @property
    def effective_mode(self) -> str:
        """The mode that changes anything: the baseline compresses nothing, so its mode is always ``context``."""
        return "context" if self.policy.is_none else self.mode

    @property
    def kv_dtype_name(self) -> str | None:
        """The cache dtype's name (``bfloat16``), or ``None`` for the model's deployment dtype."""
        return dtype_name(self.kv_dtype) if self.kv_dtype is not None else None

    @property
    def key(self) -> str:
        """One string naming the run: ``spec[@query][@kv_dtype=float16]``; :meth:`parse` reads it back."""
        text = self.spec + ("@query" if self.effective_mode == "query" else "")
        return text + (f"@kv_dtype={self.kv_dtype_name}" if self.kv_dtype is not None else "")

    def __str__(self) -> str:
        return self.key

    def with_mode(self, mode: str) -> "RunSpec":
        return replace(self, mode=parse_mode(mode))

    def generation_kwargs(self) -> dict:
        """Keyword arguments for :func:`kveval.runner.generation.generate` and ``generate_many``."""
        kwargs = {"mode": self.mode}
        if self.kv_dtype is not None:
            kwargs["kv_dtype"] = self.kv_dtype
        return kwargs

    def for_model(self, model) -> "RunSpec":
        """This spec checked against ``model``'s config, before any weights load.

        ``model``: a model name as :func:`kveval.runner.models.load_model` takes it, a
        config (``PretrainedConfig`` or dict) or a loaded model. Unset
        quantization groups adapt to the head width (or the low-rank width); an
        explicit group that does not divide it, or a rank above ``head_dim``,
        raises :class:`PolicySpecError`. A model whose config cannot be read
        here is returned unchanged: loading it reports the problem.
        """
        native = _native_config(model)
        if native is not None:  # DeepSeek V3.2 / V4: their own cache's parts (kveval.cache.native_layers)

            check_cache(cache_shape(native), self.policy)
            check_policy(native, self.policy)
            if self.policy.is_none:
                return self
            stack = _copy_stack(self.policy)
            stack.fit_groups(math.gcd(*_native_widths(native)))
            return replace(self, policy=stack)
        shape = _model_shape(model)
        if shape is None or self.policy.is_none:
            return self

        refuse_model_indexer(self.policy, shape.name)
        refuse_indexer_term(self.policy, shape.name)
        check_cache(shape.cache_shape, self.policy)
        quantization = self.policy.quantization
        if shape.mla_dim is not None and quantization is not None and quantization.mla_refusal(shape.name):
            raise UnsupportedModelError(quantization.mla_refusal(shape.name))
        if shape.mla_dim is not None and self.policy.selection is not None and self.policy.selection.reconstructs:
            raise self.policy.selection.mla_refusal(shape.name)
        if self.policy.cross_layer:  # refuse, before the weights load, a map naming no layer of it or two kinds
            reading_layers(shape, self.policy)
            merged_layers(shape, self.policy)
        head_dim = shape.head_dim
        stack = _copy_stack(self.policy)
        structure = stack.structure
        if structure is not None and shape.mla_dim is None:
            widths = structure.model_widths(shape.kv_heads, head_dim)
            for kind, width in (widths or {}).items():
                if width > head_dim:
                    raise PolicySpecError(f"{structure.spec()}: {kind} rank {width} exceeds head_dim={head_dim} of "
                                          f"{shape.name}; use at most {head_dim}")
        if shape.mla_dim is None:
            stack.fit_groups(head_dim)
        elif stack.quantization is not None and structure is None:  # the latent coded as K, the RoPE key as V
            stack.quantization.check_part_widths({"latent": shape.mla_dim - shape.mla_rope},
                                                 {"RoPE key": shape.mla_rope} if shape.mla_rope else {})
        return replace(self, policy=stack)


def _copy_stack(stack: PolicyStack) -> PolicyStack:
    """A copy whose policies can be adapted to one model without changing ``stack`` (calibrations stay shared)."""
    import copy

    return PolicyStack(*(copy.copy(p) if p is not None else None for p in (stack.selection, stack.structure, stack.quantization)))


def _native_config(model) -> "dict | None":
    """``model``'s text config as a dict (a name, folder or ``config.json`` path, dict, config or loaded model) where
    its cache is one kveval mirrors part by part (:data:`~kveval.modeling.layer_types.NATIVE_MODEL_TYPES`), else
    ``None`` (also where it cannot be read here: loading it reports that)."""
    if hasattr(model, "config") and not isinstance(model, dict):
        model = model.config
    if hasattr(model, "get_text_config"):
        model = model.get_text_config(decoder=True).to_dict()
    elif isinstance(model, (str, Path)):
        path = Path(model).expanduser()
        path = path / "config.json" if path.is_dir() else path
        if path.name != "config.json" or not path.is_file():
            return None
        try:
            model = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError):
            return None
    if not isinstance(model, dict):
        return None
    model = model.get("text_config") or model
    return model if model.get("model_type") in NATIVE_MODEL_TYPES else None


def _native_widths(config: dict) -> tuple[int, ...]:
    """The widths a quantizer's per-token groups must divide in such a model's store part: V4's K=V head, V3.2's
    latent and RoPE key (its other parts fit their own groups: :func:`kveval.cache.native_layers.part_coding`)."""
    if config["model_type"] == "deepseek_v4":
        return (int(config.get("head_dim") or 512),)
    return int(config.get("kv_lora_rank") or 512), int(config.get("qk_rope_head_dim") or 64)


def _model_shape(model):
    """The cache-relevant shape of ``model`` (name, config or loaded model), or ``None`` if its config is unreadable."""
    if hasattr(model, "config") and not isinstance(model, dict):
        model = model.config
    try:
        return load_model_spec(model)
    except (ValueError, OSError):
        return None


def check_lengths(model, lengths, source: str) -> None:
    """Refuse probe lengths (tokens) that reach past ``model``'s positions (``max_position_embeddings`` of its config,
    read without weights), before any item is generated: a length of ten million would otherwise build its texts
    for minutes before the request check sees it. A model whose config cannot be read here, or that grows its
    positions (dynamic NTK), is left to that check."""
    shape = _model_shape(model)
    limit = shape.max_position if shape is not None else None
    for length in lengths:
        if limit and length >= limit:
            raise UsageError(f"{source}: length {length} reaches past {shape.name}'s {limit} positions "
                             f"(max_position_embeddings); give lengths below {limit}, leaving room for the question "
                             f"and the answer")


def parse_run_specs(policies, model=None, mode: str | None = None, kv_dtype=None) -> list[RunSpec]:
    """Parse several specs (duplicates by canonical key dropped, order kept), checked against ``model``'s config.

    The one call each command makes at its edge, before the model loads.
    """
    specs: dict[str, RunSpec] = {}
    for policy in policies:
        spec = policy if isinstance(policy, RunSpec) else RunSpec.parse(policy, default_mode=parse_mode(mode), kv_dtype=kv_dtype)
        if model is not None:
            spec = spec.for_model(model)
        specs.setdefault(spec.key, spec)
    return list(specs.values())


def recorded_policy(info) -> PolicyStack:
    """The policy a run recorded (``info.policy``, the spec of a :class:`~kveval.runs.records.RunInfo`) as the typed
    stack, parsed here once for whoever loads the run; a :class:`~kveval.errors.PolicySpecError` where this process
    does not know it (a policy registered in the process that ran it)."""
    return parse_policy(info.policy)



# --- where a run of a spec lives -------------------------------------------------------------------------------

def run_slug(text: str) -> str:
    """A folder name for a model or policy spec: ``snapkv(ratio=0.5)+kivi(bits=4)`` -> ``snapkv_ratio-0.5+kivi_bits-4``."""
    text = text.replace("=", "-").replace(",", "_").replace("(", "_").replace(")", "")
    return re.sub(r"[^A-Za-z0-9_.+-]", "_", text).strip("_") or "none"


def model_identity(name: str, revision: str | None = None) -> dict:
    """Which model ``name`` is, exactly: ``{"name", "source", "revision", "hash"}``.

    ``source`` is ``embedded:<name>`` for an embedded model, the resolved
    absolute path of a local folder or ``.gguf`` file, else the Hub id;
    ``revision`` is the Hub revision (``main`` unless given; ``None`` for
    local files). ``hash`` is the first 8 hex digits of SHA-256 over source
    and revision: ``org1/M`` and ``org2/M``, or two ``.../final`` folders,
    get different hashes.
    """
    name = str(name)
    path = Path(name).expanduser()
    if name in EMBEDDED:
        source, revision = f"embedded:{name}", None
    elif path.exists() or path.suffix == ".gguf":
        source, revision = str(path.resolve()), None
    else:
        source, revision = name, revision or "main"
    digest = hashlib.sha256(f"{source}@{revision}".encode()).hexdigest()[:8]
    return {"name": name, "source": source, "revision": revision, "hash": digest}


def model_folder(identity: dict) -> str:
    """Folder name of a model's runs: an embedded model's name, else ``<last path part>-<hash>``."""
    if identity["source"].startswith("embedded:"):
        return run_slug(identity["name"])
    return f"{run_slug(Path(identity['name']).name)}-{identity['hash']}"


def run_dir_for(root: Path, identity: dict, spec: RunSpec) -> Path:
    """``<root>/runs/<model folder>/<policy slug>[@query][@kv-<dtype>]``."""
    suffix = ("@query" if spec.effective_mode == "query" else "") + (f"@kv-{spec.kv_dtype_name}" if spec.kv_dtype is not None else "")
    return Path(root) / "runs" / model_folder(identity) / (run_slug(spec.spec) + suffix)


__all__ = ["MODES", "RunSpec", "check_lengths", "check_mode", "model_folder", "model_identity", "parse_mode",
           "parse_run_specs", "recorded_policy", "run_dir_for", "run_slug"]
