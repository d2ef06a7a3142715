"""CriticalKV: SnapKV scores, the second half of the budget rescaled by what each value adds to the output."""

from __future__ import annotations

from dataclasses import dataclass

from kveval.lazy import torch

from kveval.errors import PolicySpecError
from kveval.policies.snapkv import SnapKVPolicy
from kveval.tensors.scoring_state import ScoringState

_OUT_PROJECTIONS = ("o_proj", "out_proj", "dense", "c_proj")


@dataclass
class CriticalKVPolicy(SnapKVPolicy):
    """CriticalKV (Feng et al. 2025, "Identify Critical KV Cache in LLM Inference from an Output Perturbation
    Perspective"), over SnapKV's scores as kvpress's ``CriticalKVPress(SnapKVPress())``.

    Two stages per KV head: the best ``first_stage`` share of the kept count goes by SnapKV's scores alone; the
    rest by ``(score + epsilon) x ||V W_o||_1`` (``score``: the window's mean attention, as kvpress), the L1 norm of each value through its query heads' slices of the
    layer's output projection, averaged over the query heads sharing the KV head. Where the layer has no output
    projection kveval can read per head (an MLA latent, a fused or unusual projection), the second stage weighs
    by the value's own L1 norm. Reads values and the model's weights.

    Attributes
    ----------
    first_stage : float
        Fraction of the kept tokens chosen by the base scores alone (kvpress's ``first_stage_ratio``).
    epsilon : float
        Added to the base scores before rescaling.
    """

    name = "criticalkv"
    description = "CriticalKV: SnapKV scores, half the budget reweighted by |V W_o|_1 (output perturbation)"
    reads_values = True
    first_stage: float = 0.5
    epsilon: float = 1e-4

    def __post_init__(self):
        super().__post_init__()
        if not 0 <= self.first_stage <= 1:
            raise PolicySpecError(f"criticalkv: first_stage={self.first_stage} must be in [0, 1] (share of the budget)")

    def scores(self, state: ScoringState) -> torch.Tensor:
        # SnapKV's attention summed over the window's queries, as their mean (kvpress's scale): epsilon is added to it.
        base = super().scores(state).float() / self.window
        n = base.shape[-1]
        first = int(self.keep_count(n, state.layer_idx, state.num_layers) * self.first_stage)
        rescaled = (base + self.epsilon) * projected_norms(state.values.float(), state.model, state.layer_idx)
        if first:
            rescaled.scatter_(-1, base.topk(first, dim=-1).indices, float("inf"))
        return rescaled


def projected_norms(values: torch.Tensor, model, layer_idx: int) -> torch.Tensor:
    """``[kv_heads, n]``: ``||v W_o^h||_1`` per token, averaged over the query heads ``h`` reading each KV head, with
    ``W_o^h`` the rows of layer ``layer_idx``'s output projection that head ``h``'s output meets; the value's
    own L1 norm where no such projection is found."""
    weight = _output_weight(model, layer_idx)
    kv_heads, n, d = values.shape
    if weight is None or weight.shape[1] % d or (weight.shape[1] // d) % kv_heads:
        return values.abs().sum(dim=-1)
    heads = weight.shape[1] // d
    slices = weight.float().T.reshape(kv_heads, heads // kv_heads, d, weight.shape[0])  # [kv, group, d, hidden]
    return torch.einsum("knd,kgdh->kgnh", values, slices.to(values.device)).abs().sum(dim=-1).mean(dim=1)


def _output_weight(model, layer_idx: int) -> "torch.Tensor | None":
    """The output projection's weight (``[hidden, heads x head_dim]``) of the attention module of ``layer_idx``."""
    if model is None:
        return None
    for module in model.modules():
        if getattr(module, "layer_idx", None) == layer_idx:
            for name in _OUT_PROJECTIONS:
                linear = getattr(module, name, None)
                if isinstance(linear, torch.nn.Linear):
                    return linear.weight.detach()
    return None
