"""What a selection policy may look at for one sequence in one layer (:class:`ScoringState`), below both the cache and the policies."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


@dataclass
class ScoringState:
    """What a selection policy may look at for one sequence in one layer.

    Attributes
    ----------
    keys : torch.Tensor or None
        Stored keys (dequantized), ``[kv_heads, tokens, head_dim]``, after RoPE; ``None`` for a policy that
        declares it never reads them (``scores_stack_layers``).
    positions : torch.Tensor
        Original sequence position of every stored token, ``[kv_heads, tokens]``.
    attention : torch.Tensor or None
        Attention mass each token received from the queries the policy asked
        for (``SelectionPolicy.attention``), summed over those queries and
        averaged over the query heads that share each KV head (GQA/MQA),
        ``[kv_heads, tokens]``; ``None`` for ``attention == "none"``.
    layer_idx, num_layers : int
        Which layer this is, for layer-dependent budgets.
    seed : int or tuple of int
        Per-sequence seed for the ``random`` control (one per row for a batch: see ``batch_scores``).
    model : PreTrainedModel or None
        The model the cache serves, for policies calibrated per model (``duo``) or reading its weights
        (``criticalkv``'s output projection).
    values : torch.Tensor or None
        Stored values (dequantized), ``[kv_heads, tokens, head_dim]``; only for a policy that declares it reads
        them (``SelectionPolicy.reads_values``), else ``None``.
    queries, query_positions : torch.Tensor or None
        The prefill's queries as attention read them (after RoPE), ``[query_heads, q, head_dim]``, and their
        positions, ``[q]`` (a sliding layer may already hold fewer tokens than it had queries); only for
        ``attention == "queries"`` (Expected Attention), else ``None``.

    With per-head budgets, heads may hold fewer tokens than the slots shown:
    their padding slots have zero keys, zero attention and position ``-1``,
    and whatever a policy scores them is replaced by ``-inf``.
    """

    keys: "torch.Tensor | None"
    positions: "torch.Tensor"
    attention: "torch.Tensor | None"
    layer_idx: int
    num_layers: int
    seed: "int | tuple[int, ...]" = 0
    model: object = None
    values: "torch.Tensor | None" = None
    queries: "torch.Tensor | None" = None
    query_positions: "torch.Tensor | None" = None


