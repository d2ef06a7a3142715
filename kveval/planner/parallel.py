"""How a serving engine spreads a model over GPUs, and what each GPU then holds: the KV cache's share and the
weights' (:class:`Deployment`, :func:`layout`). Torch-free: the rules are read from the engines' sources, named in
each docstring (vLLM 0.33.0 and SGLang 0.5.23 wheels), and restated here as arithmetic.

Which caches split across tensor-parallel ranks:

* per-head K/V split by KV heads: each rank holds ``max(1, kv_heads // tp)`` of them, so a model with fewer KV heads
  than ranks replicates them (vLLM ``ModelConfig.get_num_kv_heads``, ``vllm/config/model.py``; SGLang
  ``ModelConfig.get_num_kv_heads``, ``sglang/srt/configs/model_config.py``);
* an MLA latent, DSA's indexer keys and DeepSeek-V4's caches are one vector a token, replicated on every rank of the
  attention-TP group: vLLM gives their specs ``max_tp_shards=1`` (``MLAAttention.get_kv_cache_spec`` in
  ``vllm/model_executor/layers/attention/mla_attention.py``; ``vllm/models/deepseek_v4/attention.py`` and
  ``compressor.py``), and ``_layer_tp_replicas`` (``vllm/v1/core/kv_cache_planning.py``) makes every rank past the
  first a replica; ``get_num_kv_heads`` returns 1 for MLA. SGLang's ``_compute_cell_size``
  (``sglang/srt/model_executor/pool_configurator.py``) sizes the MLA cell, and DSA's indexer cell, without dividing
  by the attention-TP size.

Data parallelism shards requests: each DP rank keeps its own KV pool for its own requests.

* vLLM: ``--data-parallel-size D`` runs D engine instances of ``--tensor-parallel-size T`` ranks each (T x D GPUs);
  attention is data parallel across them, and a MoE's experts are sharded across all T x D ranks
  (``FusedMoEParallelConfig.make`` flattens TP across DP, ``vllm/model_executor/layers/fused_moe/config.py``),
  by tensor parallelism or, with ``--enable-expert-parallel``, by experts: the same bytes a GPU. vLLM has no
  ``--enable-dp-attention``: its DP is data-parallel attention.
* SGLang: ``--tp T --dp D --enable-dp-attention`` runs T GPUs in all; attention is tensor parallel over
  ``T // D`` of them (``derive_attn_tp_size``, ``sglang/srt/runtime_context.py``) and data parallel across the D
  groups, while the MoE stays sharded across all T. Without ``--enable-dp-attention``, ``--dp D`` runs D replicas of
  T GPUs each (T x D GPUs).

Weights per GPU: the routed experts over the expert-sharding width, the rest (attention, dense MLPs, embeddings: not
told apart here) over the attention-TP width. Where the planner does not know the experts' share, all the weights
count as the rest (an upper bound under DP attention, exact without it).
"""

from __future__ import annotations

from dataclasses import dataclass

from kveval.errors import UsageError
from kveval.planner.model_specs import ModelSpec

#: Engines whose parallel layout this module knows.
PARALLEL_ENGINES = ("vllm", "sglang")


@dataclass(frozen=True)
class Deployment:
    """An engine's parallel flags: ``--tensor-parallel-size`` (SGLang ``--tp``), ``--data-parallel-size`` (SGLang
    ``--dp``) and SGLang's ``--enable-dp-attention``."""

    tensor_parallel: int = 1
    data_parallel: int = 1
    dp_attention: bool = False

    def flags(self, engine: str) -> str:
        if engine == "sglang":
            return (f"--tp {self.tensor_parallel} --dp {self.data_parallel}"
                    + (" --enable-dp-attention" if self.dp_attention else ""))
        return f"--tensor-parallel-size {self.tensor_parallel} --data-parallel-size {self.data_parallel}"


@dataclass(frozen=True)
class Layout:
    """What a deployment makes of a model: ``gpus`` in all; ``attention_tp`` ranks share each KV pool;
    ``pools`` independent KV pools (DP ranks, each with its own requests); each GPU holds ``kv_share`` of a
    sequence's cache and ``weights_bytes`` of the weights (``None``: not known)."""

    gpus: int
    attention_tp: int
    pools: int
    expert_width: int
    kv_share: float
    kv_rule: str
    weights_bytes: int | None
    weights_rule: str


def _positive(value, what: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UsageError(f"{what}={value!r} must be a whole number >= 1")
    return value


def layout(engine: str, spec: ModelSpec, deployment: Deployment, weights: "tuple[int, int] | int | None") -> Layout:
    """``deployment`` of ``spec`` on ``engine`` (see the module doc); ``weights``: ``(rest, routed experts)`` bytes,
    or their total where the split is not known, or ``None``. Refused in one line: a width below 1, SGLang's DP
    attention with a ``--dp`` that does not divide ``--tp``, vLLM's ``--enable-dp-attention`` (it has none), and
    attention heads that the attention-TP width does not divide (vLLM ``ModelConfig.verify_with_parallel_config``;
    SGLang's ``DeepseekV2AttentionMLA`` asserts ``num_heads % attn_tp_size == 0``)."""
    if engine not in PARALLEL_ENGINES:
        raise UsageError(f"engine {engine!r}: tensor and data parallelism are planned for {', '.join(PARALLEL_ENGINES)}")
    tp = _positive(deployment.tensor_parallel, "tensor_parallel_size")
    dp = _positive(deployment.data_parallel, "data_parallel_size")
    if engine == "vllm":
        if deployment.dp_attention:
            raise UsageError("vLLM has no --enable-dp-attention: its --data-parallel-size is data-parallel attention "
                             "(each DP rank its own requests and KV cache, the experts across tp x dp); drop it")
        gpus, attention_tp, expert_width = tp * dp, tp, tp * dp
    elif deployment.dp_attention:
        if tp % dp:
            raise UsageError(f"SGLang --enable-dp-attention splits --tp {tp} into --dp {dp} attention groups: give a "
                             f"--dp that divides --tp")
        gpus, attention_tp, expert_width = tp, tp // dp, tp
    else:
        gpus, attention_tp, expert_width = tp * dp, tp, tp
    heads = spec.num_attention_heads
    if heads and heads % attention_tp:
        flag = "--tensor-parallel-size" if engine == "vllm" else "--tp / --dp (the attention-TP width)"
        raise UsageError(f"{spec.name}: {heads} attention heads do not split across {attention_tp} attention-TP ranks; "
                         f"give a {flag} that divides {heads}")
    if spec.mla_dim is not None or spec.native_only:
        share, rule = 1.0, (f"one latent a token (MLA, DSA indexer keys, V4 entries): replicated on each of the "
                            f"{attention_tp} attention-TP ranks")
    else:
        per_rank = max(1, spec.kv_heads // attention_tp)
        share = per_rank / spec.kv_heads
        rule = (f"{spec.kv_heads} KV heads over {attention_tp} attention-TP ranks: {per_rank} a rank"
                + (" (replicated: fewer KV heads than ranks)" if spec.kv_heads < attention_tp else ""))
    if weights is None:
        size, how = None, "not known"
    elif isinstance(weights, tuple):
        rest, experts = weights
        size = -(-rest // attention_tp) + -(-experts // expert_width)
        how = (f"routed experts over {expert_width} GPUs, the rest over {attention_tp}"
               if experts else f"over {attention_tp} GPUs")
    else:
        size = -(-weights // attention_tp)
        how = (f"over {attention_tp} GPUs (the experts' share not known: all counted as attention-TP sharded"
               + (", an upper bound)" if expert_width != attention_tp else ")"))
    rule += f"; {dp} {'DP rank' if dp == 1 else 'DP ranks'}, each its own requests and KV pool"
    return Layout(gpus, attention_tp, dp, expert_width, share, rule, size, how)


__all__ = ["Deployment", "Layout", "PARALLEL_ENGINES", "layout"]
