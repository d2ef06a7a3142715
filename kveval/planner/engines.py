"""The deployment question in an engine's own terms: the KV pool vLLM, SGLang or llama.cpp allocates, and what fits.

vLLM and SGLang are planned on each GPU of a deployment (``--tensor-parallel-size``, ``--data-parallel-size``,
SGLang's ``--enable-dp-attention``: :mod:`kveval.planner.parallel` says which caches split and which replicate, and
each GPU's share of the weights), in each engine's blocks or pages for the model (:data:`BLOCK_SIZES`); SGLang's pool
is ``total x --mem-fraction-static`` less the weights, as vLLM's is with ``--gpu-memory-utilization``.

vLLM (V1; ``vllm/v1/worker/gpu_worker.py`` ``determine_available_memory``, ``vllm/v1/core/kv_cache_utils.py``
``get_num_blocks``): the KV pool is ``gpu_memory x gpu_memory_utilization`` less the weights and the peak of
everything else (activations of the profile run, CUDA graphs, non-torch allocations: ``overhead`` here, which
kveval cannot profile and takes as given, default 0). The pool is cut into blocks of ``block_size`` (16; 64 and
256 on DeepSeek's caches) tokens
of every layer; a sequence of ``max_model_len`` tokens takes ``ceil(max_model_len / 16)`` blocks. Sequences of
that length that fit = blocks // blocks per sequence, at most ``max_num_seqs`` at once; vLLM refuses to start when
not even one fits. vLLM 0.33 logs the pool in one line (``vllm/v1/core/kv_cache_utils.py``,
``update_kv_cache_capacity``): "GPU KV cache size: T tokens, Maximum concurrency for N tokens per request: C.CCx",
where C = blocks / ceil(N / 16) (``get_max_concurrency_for_kv_cache_config``) and T = int(C x N)
(``get_kv_cache_capacity``), which this module reproduces for models without sliding layers (blocks x 16 / N in
older versions: the same when N is a multiple of 16). ``--max-model-len`` is read as vLLM reads it
(:func:`~kveval.planner.units.parse_vllm_int`: ``32k`` is 32,000, ``32K`` 32,768).

llama.cpp (``llama-server --ctx-size C --parallel P``): one KV buffer of ``C`` cells (padded up to a multiple of
256, as ``llama_kv_cache`` pads with flash attention) for all layers, shared by the ``P`` slots (each slot a
context of ``C / P`` tokens); its bytes are cells x the cache types' row bytes (ggml blocks with their scales). It
fits when weights + that buffer + ``overhead`` (compute buffers) stay within the GPU's memory.

Bytes per token come from the presets' policies (:mod:`kveval.policies.engines`) through the planner
(:func:`kveval.planner.memory.plan`), so the deployment answer uses the footprint kveval measures. Sliding-window
layers are sized as kveval's cache holds them (``window - 1`` tokens a sequence); vLLM's hybrid allocator and
llama.cpp's SWA cache round those differently, which this module does not model (it says so in ``notes``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field

from kveval.errors import UsageError
from kveval.planner.fit import stored_weights
from kveval.planner.memory import human_bytes, parse_size, plan
from kveval.planner.model_specs import load_model_spec
from kveval.planner.parallel import Deployment, layout
from kveval.planner.units import parse_vllm_int
from kveval.policies.spec import parse_policy

VLLM_BLOCK_SIZE = 16
LLAMACPP_CTX_PAD = 256
ENGINES = ("vllm", "sglang", "llamacpp")

#: The presets each engine's question is answered at, as policy specs (``none``: the model dtype, vLLM's ``auto``
#: and llama.cpp's ``f16``).
ENGINE_PRESETS = {
    "vllm": ("none", "vllm(kv_cache_dtype=fp8)"),
    "sglang": ("none", "sglang(kv_cache_dtype=fp8_e4m3)"),
    "llamacpp": ("llamacpp(k=f16,v=f16)", "llamacpp(k=q8_0,v=q8_0)", "llamacpp(k=q8_0,v=q4_0)",
                 "llamacpp(k=q5_1,v=q5_1)", "llamacpp(k=q5_0,v=q5_0)", "llamacpp(k=q4_1,v=q4_1)",
                 "llamacpp(k=q4_0,v=q4_0)"),
}


#: The flag each engine's KV cache dtype is given by, as its preset's argument (``--kv-cache-dtype X`` is the preset
#: ``engine(kv_cache_dtype=X)``); llama.cpp's K and V types are two flags, given as presets.
KV_CACHE_DTYPE_ARGUMENT = {"vllm": "kv_cache_dtype", "sglang": "kv_cache_dtype"}


def kv_cache_dtype_presets(engine: str, dtype: str, presets: list[str] | None) -> list[str]:
    """``--kv-cache-dtype``: the engine's preset at ``dtype`` beside the model dtype (and any ``--presets``); the
    preset parses the name, refusing one kveval does not reproduce in one line."""
    argument = KV_CACHE_DTYPE_ARGUMENT.get(engine)
    if argument is None:
        raise UsageError(f"--kv-cache-dtype is vLLM's and SGLang's flag; {ENGINE_NAMES[engine]}'s cache types are presets, e.g. "
                         f"--presets '{ENGINE_PRESETS[engine][-1]}'")
    spec = f"{engine}({argument}={dtype})"
    parse_policy(spec)
    return list(dict.fromkeys(["none", *(presets or []), spec]))


@dataclass
class PresetFit:
    """One preset under one engine deployment."""

    preset: str
    bytes_per_token: float
    sequence_bytes: int  # one sequence (vLLM: max_model_len in whole blocks; llama.cpp: the whole buffer)
    blocks: int | None  # vLLM: blocks in the pool
    sequences: int  # vLLM: sequences of max_model_len that fit (before max_num_seqs); llama.cpp: largest --parallel
    concurrent: int  # vLLM: min(sequences, max_num_seqs); llama.cpp: --parallel when it fits, else 0
    max_concurrency: float | None  # vLLM's log line: blocks / ceil(max_model_len / block_size)
    fits: bool
    verdict: str | None = None  # the gate's, where a gate.json judged this preset on this model (join_verdicts)
    #: vLLM's "GPU KV cache size: N tokens": int(max_concurrency x max_model_len) (None: llama.cpp, sliding layers)
    kv_cache_tokens: int | None = None


@dataclass
class EnginePlan:
    engine: str
    model: str
    gpu_bytes: int
    weights_bytes: int
    overhead_bytes: int
    pool_bytes: int  # vLLM: the KV pool; llama.cpp: memory left for the KV buffer
    settings: dict
    presets: list[PresetFit]
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _check_fraction(value, what: str) -> float:
    if not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise UsageError(f"{what}={value!r} must be a fraction in (0, 1], e.g. 0.9")
    return float(value)


def _check_positive(value, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UsageError(f"{what}={value!r} must be a positive integer")
    return value


def _weights(spec, weights, dtype_bytes: int, notes: list[str], per_param=None) -> int:
    """Given weights; else the checkpoint's as stored, where known; else parameters x ``per_param`` (default
    ``dtype_bytes``)."""
    if weights is not None:
        return parse_size(weights, "weights")
    if per_param is None and (stored := stored_weights(spec, notes)) is not None:
        return stored[0]
    if per_param is not None:
        if not isinstance(per_param, (int, float)) or isinstance(per_param, bool) or not per_param > 0:
            raise UsageError(f"weight_bytes_per_param={per_param!r} must be a positive number (2 = bf16, 1 = fp8)")
        dtype_bytes = per_param
    if not spec.num_parameters:
        raise UsageError(f"cannot estimate the weights of {spec.name} from its config; give them, e.g. --weights 16GB")
    size = int(math.ceil(spec.num_parameters * dtype_bytes))
    notes.append(f"weights estimated: {spec.num_parameters / 1e9:.2f}e9 parameters x {dtype_bytes:g} bytes = {human_bytes(size)}")
    return size


@functools.cache
def _preset_stacks(engine: str) -> tuple:
    """:data:`ENGINE_PRESETS` of ``engine``, parsed once: ``(spec, stack)`` each (the planner never changes a stack)."""
    return tuple((text, parse_policy(text)) for text in ENGINE_PRESETS[engine])


#: How each engine's name reads in a sentence.
ENGINE_NAMES = {"vllm": "vLLM", "sglang": "SGLang", "llamacpp": "llama.cpp"}


def _presets(engine: str, presets, spec, dtype_bytes: int, notes: list[str]) -> list:
    """The presets to answer at: the given spec strings (parsed here, at the edge), each refused unless ``engine``
    serves it (the baseline ``none``, the model dtype, or a format whose :attr:`serving_engine` is ``engine``); else
    the engine's own, less those the model cannot hold (a block format wider than its heads), which a note names."""
    if presets:
        stacks = [(text, parse_policy(text)) for text in presets]
        for text, stack in stacks:
            served = stack.quantization.serving_engine if stack.quantization is not None else None
            if not stack.is_none and (served != engine or stack.selection is not None or stack.structure is not None):
                own = ", ".join(ENGINE_PRESETS[engine])
                raise UsageError(f"preset {text!r}: {ENGINE_NAMES[engine]} has no such KV cache"
                                 + (f" (it is {served}'s format)" if served and served != engine else "")
                                 + f"; give presets {ENGINE_NAMES[engine]} runs: {own}")
        return stacks
    kept = []
    for text, stack in _preset_stacks(engine):
        try:
            plan(spec, 1, 1, stack, dtype_bytes)
        except ValueError as exc:
            notes.append(f"{text} left out: {exc}")
            continue
        kept.append((text, stack))
    if not kept:
        raise UsageError(f"none of {ENGINE_NAMES[engine]}'s KV cache presets applies to {spec.name}: "
                         f"{notes[-1].split(' left out: ', 1)[1]}")
    return kept


def _positions_note(spec, tokens: int, flag: str, notes: list[str]) -> None:
    """Note a sequence longer than the model's positions, as the plain planner does."""
    if spec.max_position and tokens > spec.max_position:
        notes.append(f"{flag} {tokens:,} tokens exceeds the model's max_position_embeddings ({spec.max_position:,}); "
                     f"the engine refuses it unless RoPE scaling extends the positions")


def _sliding_note(spec, engine: str, notes: list[str]) -> None:
    if any(w is not None for w in spec.windows):
        notes.append(f"{spec.name} has sliding-window layers, sized as kveval's cache holds them (window - 1 tokens "
                     f"a sequence); {engine}'s own allocator rounds them differently")


#: Tokens a KV block (vLLM) or page (SGLang) holds for each kind of cache, as each engine picks it on Hopper GPUs
#: (H100/H200) unless ``--block-size`` / ``--page-size`` says otherwise:
#:
#: * vLLM: 16 by default; MLA and DSA (DeepSeek V2/V3/V3.2) run FlashMLA, whose kernels take blocks of 64 only
#:   (``get_supported_kernel_block_sizes`` in ``vllm/v1/attention/backends/mla/flashmla.py`` and
#:   ``flashmla_sparse.py``); DeepSeek-V4 "uses 256-token KV pages" (``vllm/models/deepseek_v4/sparse_mla.py``,
#:   ``get_warmup_keys``; its recipes pass ``--block-size 256``);
#: * SGLang: pages of 1 token by default (FA3 on Hopper); 64 for DSA (``page_size = 64 * index_kpool`` in
#:   ``sglang/srt/arg_groups/model_overrides/deepseek_v2.py``), 256 for DeepSeek-V4 (``model_overrides/deepseek_v4.py``).
#:
#: DeepSeek-V4.1, which neither engine runs in these releases, is planned with V4's pages (an assumption).
BLOCK_SIZES = {"vllm": {"v4": 256, "dsa": 64, "mla": 64, "heads": 16},
               "sglang": {"v4": 256, "dsa": 64, "mla": 1, "heads": 1}}


def cache_family(spec) -> str:
    """The kind of cache that decides an engine's block size: ``v4`` (V4/V4.1's compressed layout), ``dsa`` (an
    MLA latent with indexer keys), ``mla`` or ``heads`` (per-head K/V)."""
    return "v4" if spec.v4 is not None else "dsa" if spec.indexer_dim else "mla" if spec.mla_dim is not None else "heads"


def _deployment_weights(spec, weights, dtype_bytes: int, notes: list[str], per_param, deployment):
    """The weights for :func:`~kveval.planner.parallel.layout`: the whole model's bytes (given, else as stored, else
    estimated; :func:`_weights`), split into the rest and the routed experts where the checkpoint's split is known
    and the weights were not given; on one GPU, the total."""
    total = _weights(spec, weights, dtype_bytes, notes, per_param)
    if deployment == Deployment() or weights is not None or per_param is not None or spec.weights is None:
        return total
    return spec.weights.split(spec.num_parameters) or total


def _pool_plan(engine: str, model, gpu_memory, *, fraction: float, max_model_len: int, max_num_seqs: int, weights,
               overhead, dtype_bytes: int, presets, weight_bytes_per_param, deployment: "Deployment | None",
               block_size: "int | None", notes: list[str]) -> EnginePlan:
    """A paged engine's KV pool on each GPU of a deployment and the requests of ``max_model_len`` tokens it holds
    (vLLM and SGLang alike: ``gpu_memory x fraction`` less that GPU's weights and ``overhead``, cut into blocks)."""
    spec = load_model_spec(model)
    notes[:0] = [spec.origin] if spec.origin else []
    gpu = parse_size(gpu_memory, "gpu_memory")
    deployment = deployment or Deployment()
    block = BLOCK_SIZES[engine][cache_family(spec)] if block_size is None else _check_positive(block_size, "block_size")
    weight_total = _deployment_weights(spec, weights, dtype_bytes, notes, weight_bytes_per_param, deployment)
    shape = layout(engine, spec, deployment, weight_total)
    weight_bytes = shape.weights_bytes
    extra = parse_size(overhead, "overhead") if overhead not in (None, 0, "0", "") else 0
    name = ENGINE_NAMES[engine]
    if not extra:
        notes.append(f"overhead 0: {name} also subtracts the profile run's peak activations, CUDA graphs and non-torch "
                     f"memory, which only a run measures ({name} logs them); give --overhead to include them")
    pool = max(0, math.ceil(gpu * fraction) - weight_bytes - extra)  # requested memory: ceil(total x fraction)
    if deployment != Deployment():
        notes.append(f"{deployment.flags(engine)}: {shape.gpus} GPUs; KV: {shape.kv_rule}; weights a GPU: "
                     f"{shape.weights_rule}")
    _sliding_note(spec, name, notes)
    _positions_note(spec, max_model_len, "--max-model-len" if engine == "vllm" else "--context-length", notes)
    blocks_per_seq = -(-max_model_len // block)
    fits = []
    for text, stack in _presets(engine, presets, spec, dtype_bytes, notes):
        block_plan = plan(spec, block, 1, stack, dtype_bytes)
        block_bytes = math.ceil(block_plan.sequence_bytes * shape.kv_share)  # one block of every layer, this GPU's
        seq = math.ceil(plan(spec, blocks_per_seq * block, 1, stack, dtype_bytes).sequence_bytes * shape.kv_share)
        full = all(w is None for w in spec.windows)
        blocks = pool // block_bytes if full else None
        per_pool = pool // seq
        # vLLM V1's get_max_concurrency_for_kv_cache_config: blocks / blocks a request of max_model_len takes
        concurrency = blocks / blocks_per_seq if blocks is not None else per_pool
        # and get_kv_cache_capacity's tokens, the "GPU KV cache size" it logs: int(concurrency x max_model_len)
        tokens = int(concurrency * max_model_len) if blocks is not None and engine == "vllm" else None
        fits.append(PresetFit(text, block_plan.bytes_per_token * shape.kv_share, seq, blocks, per_pool * shape.pools,
                              min(per_pool, max_num_seqs) * shape.pools, concurrency, per_pool >= 1,
                              kv_cache_tokens=tokens))
    if sum(spec.holds_kv) and any(not f.fits for f in fits):
        notes.append(f"a preset where not one sequence of {'max_model_len' if engine == 'vllm' else 'context_length'} "
                     f"fits: {name} refuses to start with it")
    if engine == "vllm" and any(f.kv_cache_tokens is None for f in fits):
        notes.append("vLLM's \"GPU KV cache size\" line is not reproduced for sliding-window layers: its hybrid "
                     "allocator groups them with their own block counts")
    settings = {"max_model_len": max_model_len, "max_num_seqs": max_num_seqs, "block_size": block,
                "tensor_parallel_size": deployment.tensor_parallel, "data_parallel_size": deployment.data_parallel,
                "enable_dp_attention": deployment.dp_attention, "gpus": shape.gpus,
                "attention_tp": shape.attention_tp, "kv_pools": shape.pools}
    settings["gpu_memory_utilization" if engine == "vllm" else "mem_fraction_static"] = fraction
    return EnginePlan(engine, spec.name, gpu, weight_bytes, extra, pool, settings, fits, notes)


def _max_len(max_model_len, flag: str, notes: list[str]) -> int:
    """``--max-model-len``/``--context-length``, text read as vLLM reads it (``32k`` = 32,000, ``32K`` = 32,768)."""
    if isinstance(max_model_len, str):
        text = max_model_len.strip()
        max_model_len = parse_vllm_int(text, flag.lstrip("-").replace("-", "_"))
        if text != str(max_model_len):
            how = "as vLLM reads it" if flag == "--max-model-len" else "kveval reading it as vLLM does"
            notes.append(f"{flag} {text} read as {max_model_len:,} tokens, {how} (k = 1,000, K = 1,024)")
    return _check_positive(max_model_len, flag.lstrip("-").replace("-", "_"))


def vllm_plan(model, gpu_memory, *, gpu_memory_utilization: float = 0.9, max_model_len: "int | str",
              max_num_seqs: int = 256, weights=None, overhead=0, dtype_bytes: int = 2, presets=None,
              weight_bytes_per_param: float | None = None, deployment: "Deployment | None" = None,
              block_size: int | None = None) -> EnginePlan:
    """What ``vllm serve --gpu-memory-utilization U --max-model-len N --max-num-seqs S`` (with
    ``--tensor-parallel-size`` / ``--data-parallel-size`` as ``deployment`` says) allocates on each GPU of
    ``gpu_memory``, and how many sequences of ``N`` tokens fit at each preset (see the module doc;
    :mod:`kveval.planner.parallel` for the split). ``N`` as text (``"32k"``) is read as vLLM reads it (32,000;
    ``"32K"``: 32,768), and the plan says what it read. ``weights``: the whole model's (each GPU holds its share)."""
    notes: list[str] = []
    max_model_len = _max_len(max_model_len, "--max-model-len", notes)
    return _pool_plan("vllm", model, gpu_memory, fraction=_check_fraction(gpu_memory_utilization, "gpu_memory_utilization"),
                      max_model_len=max_model_len, max_num_seqs=_check_positive(max_num_seqs, "max_num_seqs"),
                      weights=weights, overhead=overhead, dtype_bytes=dtype_bytes, presets=presets,
                      weight_bytes_per_param=weight_bytes_per_param, deployment=deployment, block_size=block_size,
                      notes=notes)


def sglang_plan(model, gpu_memory, *, mem_fraction_static: float = 0.9, context_length: "int | str",
                max_running_requests: int = 256, weights=None, overhead=0, dtype_bytes: int = 2, presets=None,
                weight_bytes_per_param: float | None = None, deployment: "Deployment | None" = None,
                page_size: int | None = None) -> EnginePlan:
    """What ``sglang.launch_server --mem-fraction-static F --context-length N`` (with ``--tp``, ``--dp`` and
    ``--enable-dp-attention`` as ``deployment`` says) allocates on each GPU: its KV pool is the memory free after
    the weights less ``total x (1 - F)`` (``_profile_available_bytes``, ``sglang/srt/mem_cache/kv_cache_configurator.py``),
    that is ``total x F`` less the weights and ``overhead``, in pages of ``page_size`` tokens; and how many
    requests of ``N`` tokens it holds at each preset (at most ``max_running_requests`` per DP rank)."""
    notes: list[str] = []
    context_length = _max_len(context_length, "--context-length", notes)
    return _pool_plan("sglang", model, gpu_memory, fraction=_check_fraction(mem_fraction_static, "mem_fraction_static"),
                      max_model_len=context_length,
                      max_num_seqs=_check_positive(max_running_requests, "max_running_requests"), weights=weights,
                      overhead=overhead, dtype_bytes=dtype_bytes, presets=presets,
                      weight_bytes_per_param=weight_bytes_per_param, deployment=deployment, block_size=page_size,
                      notes=notes)


def llamacpp_plan(model, gpu_memory, *, ctx_size: int, parallel: int = 1, weights=None, overhead=0,
                  dtype_bytes: int = 2, presets=None, weight_bytes_per_param: float | None = None) -> EnginePlan:
    """What ``llama-server --ctx-size C --parallel P`` allocates for its KV cache at each preset, whether weights
    and cache fit on a GPU of ``gpu_memory``, and the largest ``--parallel`` at ``C / P`` tokens a slot that would."""
    spec = load_model_spec(model)
    gpu = parse_size(gpu_memory, "gpu_memory")
    ctx_size = _check_positive(ctx_size, "ctx_size")
    parallel = _check_positive(parallel, "parallel")
    if ctx_size < parallel:
        raise UsageError(f"ctx_size={ctx_size} is shared by the {parallel} slots: give at least one cell a slot")
    notes: list[str] = [spec.origin] if spec.origin else []
    weight_bytes = _weights(spec, weights, dtype_bytes, notes, weight_bytes_per_param)
    extra = parse_size(overhead, "overhead") if overhead not in (None, 0, "0", "") else 0
    budget = max(0, gpu - weight_bytes - extra)
    slot = ctx_size // parallel
    cells = -(-ctx_size // LLAMACPP_CTX_PAD) * LLAMACPP_CTX_PAD
    _sliding_note(spec, "llama.cpp", notes)
    _positions_note(spec, slot, "a slot's --ctx-size / --parallel =", notes)
    fits = []
    for text, stack in _presets("llamacpp", presets, spec, dtype_bytes, notes):
        per_cell = plan(spec, 1, 1, stack, dtype_bytes)
        buffer = plan(spec, cells, 1, stack, dtype_bytes).sequence_bytes
        # largest P with P slots of `slot` tokens: the buffer of pad(P x slot) cells within the budget
        # an upper bound: no cache holds a token in fewer bytes than its amortized bytes_per_token
        lo, hi = 0, max(1, int(budget // max(1.0, per_cell.bytes_per_token * slot))) + 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            need = plan(spec, -(-(mid * slot) // LLAMACPP_CTX_PAD) * LLAMACPP_CTX_PAD, 1, stack, dtype_bytes).sequence_bytes
            lo, hi = (mid, hi) if need <= budget else (lo, mid - 1)
        fits.append(PresetFit(text, per_cell.bytes_per_token, buffer, None, lo, parallel if buffer <= budget else 0,
                              None, buffer <= budget))
    return EnginePlan("llamacpp", spec.name, gpu, weight_bytes, extra, budget,
                      {"ctx_size": ctx_size, "parallel": parallel, "slot_tokens": slot, "cells": cells}, fits, notes)


def join_verdicts(p: EnginePlan, gate: dict) -> int:
    """Put the gate's verdict (``gate.json``: :mod:`kveval.gate.report`) on each preset it judged on this model, the
    baseline's as PASS; the number of presets joined. Specs are compared in canonical form."""
    verdicts = {}
    for result in gate.get("results", []):
        base = result.get("baseline") or {}
        if base.get("model") == p.model:
            verdicts[parse_policy(base.get("policy", "none")).spec] = "PASS (baseline)"
            for c in result.get("candidates", []):
                model, _, spec = str(c.get("name", "")).partition("/")
                if model == p.model and spec:
                    try:
                        verdicts[parse_policy(spec).spec] = c.get("status")
                    except ValueError:
                        continue
    joined = 0
    for f in p.presets:
        f.verdict = verdicts.get(parse_policy(f.preset).spec)
        joined += f.verdict is not None
    return joined


def vllm_log_line(f: PresetFit, max_model_len: int) -> str:
    """vLLM 0.33's own log line for this pool (``update_kv_cache_capacity``), to set beside the one a run prints."""
    return (f"GPU KV cache size: {f.kv_cache_tokens:,} tokens, Maximum concurrency for {max_model_len:,} tokens per "
            f"request: {f.max_concurrency:.2f}x")


def format_engine_plan(p: EnginePlan) -> str:
    s = p.settings
    lines = [f"model      {p.model}"]
    judged = any(f.verdict is not None for f in p.presets)
    gate_head = "  gate" if judged else ""

    def verdict(f: PresetFit) -> str:
        return f"  {f.verdict or 'not judged'}" if judged else ""

    if p.engine in ("vllm", "sglang"):
        vllm = p.engine == "vllm"
        fraction = s["gpu_memory_utilization" if vllm else "mem_fraction_static"]
        parallel = Deployment(s["tensor_parallel_size"], s["data_parallel_size"], s["enable_dp_attention"])
        if vllm:
            lines.append(f"engine     vLLM: --gpu-memory-utilization {fraction:g} --max-model-len {s['max_model_len']:,} "
                         f"--max-num-seqs {s['max_num_seqs']} {parallel.flags('vllm')} (block size {s['block_size']})")
        else:
            lines.append(f"engine     SGLang: --mem-fraction-static {fraction:g} --context-length {s['max_model_len']:,} "
                         f"--max-running-requests {s['max_num_seqs']} {parallel.flags('sglang')} (page size "
                         f"{s['block_size']})")
        lines.append(f"GPUs       {s['gpus']}: {s['kv_pools']} KV pool(s), each over {s['attention_tp']} attention-TP "
                     f"rank(s); per GPU:")
        lines.append(f"KV pool    {human_bytes(p.pool_bytes)} = {human_bytes(p.gpu_bytes)} x {fraction:g}"
                     f" - weights {human_bytes(p.weights_bytes)} - overhead {human_bytes(p.overhead_bytes)}")
        lines.append(f"{'preset':<44} {'B/token':>10} {'per seq':>10} {'blocks':>9} {'fit':>6} {'running':>8} "
                     f"{'per pool':>10}{gate_head}")
        for f in p.presets:
            blocks = f"{f.blocks:,}" if f.blocks is not None else "-"
            lines.append(f"{f.preset:<44} {f.bytes_per_token:>10,.0f} {human_bytes(f.sequence_bytes):>10} {blocks:>9} "
                         f"{f.sequences:>6,} {f.concurrent:>8,} {f.max_concurrency:>9.2f}x{verdict(f)}")
        lines.append("B/token and per seq: on one GPU; fit: sequences of the maximum length all pools hold; running: "
                     "at most " + ("--max-num-seqs" if vllm else "--max-running-requests") + " a pool; per pool: "
                     + ("vLLM's maximum concurrency" if vllm else "sequences one pool holds"))
        lines += [f"vLLM log   {f.preset}: {vllm_log_line(f, s['max_model_len'])}" for f in p.presets
                  if f.kv_cache_tokens is not None]
    else:
        lines.append(f"engine     llama.cpp: --ctx-size {s['ctx_size']:,} --parallel {s['parallel']} "
                     f"({s['slot_tokens']:,} tokens a slot; {s['cells']:,} cells after padding to {LLAMACPP_CTX_PAD})")
        lines.append(f"budget     {human_bytes(p.pool_bytes)} = {human_bytes(p.gpu_bytes)} - weights "
                     f"{human_bytes(p.weights_bytes)} - overhead {human_bytes(p.overhead_bytes)}")
        lines.append(f"{'preset':<44} {'B/token':>10} {'KV buffer':>10} {'fits':>5} {'max --parallel':>15}{gate_head}")
        for f in p.presets:
            lines.append(f"{f.preset:<44} {f.bytes_per_token:>10,.0f} {human_bytes(f.sequence_bytes):>10} "
                         f"{'yes' if f.fits else 'no':>5} {f.sequences:>15,}{verdict(f)}")
        lines.append(f"max --parallel: slots of {s['slot_tokens']:,} tokens whose buffer fits the budget")
    lines += [f"note       {n}" for n in p.notes]
    return "\n".join(lines)
