"""R-KV: keep tokens that recent queries attend to and that few other keys repeat."""

from __future__ import annotations

from dataclasses import dataclass

from kveval.lazy import torch

from kveval.errors import PolicySpecError, UnsupportedModelError
from kveval.policies.base import RatioSelectionPolicy
from kveval.tensors.scoring_state import ScoringState


@dataclass
class RKVPolicy(RatioSelectionPolicy):
    """R-KV (Cai et al. 2025, "R-KV: Redundancy-aware KV Cache Compression for Training-Free Reasoning Models
    Acceleration"; reference code: github.com/Zefan-Cai/R-KV, ``rkv/compression/r1_kv.py`` and its ports'
    ``rkv/algo.py``), a decode-phase compression for long outputs such as reasoning traces.

    While decoding, a row that holds ``decode_budget + decode_interval`` tokens (the paper's budget and buffer)
    keeps ``decode_budget`` of them: the newest ``window`` always (the observation window), the rest by

        score = mix * importance - (1 - mix) * redundancy

    - importance: the attention of the last ``window`` queries (the row's most recent, decoded or of the prompt's
      end) over the older tokens, softmax over those tokens alone of ``q . k / sqrt(head_dim)``, the logits of the
      query heads sharing a KV head reduced by their max (GQA), averaged over the queries, then max-pooled over
      ``kernel`` neighbouring slots;
    - redundancy: per KV head, the cosine similarity of each key with every other (itself excluded); for each key,
      its most recent neighbour more similar than ``threshold`` is spared (that entry set to 0), then each key's
      column is averaged over the keys and a softmax over all keys gives its redundancy. The reference spares slot
      0 for a key with no such neighbour (an artefact of ``argmax`` over an all-zero mask); here nothing is spared
      then.

    Units: ``window`` and ``kernel`` in tokens (queries), ``mix`` is the paper's lambda (0.07, the reference's
    default), ``threshold`` a cosine similarity. The prefill may be compressed too (``ratio``/``budget`` scored
    the same way with the prompt's last ``window`` queries); ``rkv(ratio=0,decode_budget=...)`` compresses while
    decoding only. Reads the queries themselves, so it prefills alone (no shared prefill) and decodes row by row;
    an MLA latent cache, whose keys are not the queries' width, is refused.
    """

    name = "rkv"
    description = "R-KV: recent queries' attention minus key redundancy (cosine), kept while decoding"
    attention = "queries"
    window: int = 8
    kernel: int = 7
    mix: float = 0.07
    threshold: float = 0.5

    def __post_init__(self):
        super().__post_init__()
        if not isinstance(self.window, int) or self.window < 1:
            raise PolicySpecError(f"rkv: window={self.window!r} must be a positive number of queries")
        if not isinstance(self.kernel, int) or self.kernel < 1 or self.kernel % 2 == 0:
            raise PolicySpecError(f"rkv: kernel={self.kernel!r} must be a positive odd number of tokens")
        if not 0 <= self.mix <= 1:
            raise PolicySpecError(f"rkv: mix={self.mix} must be in [0, 1] (the weight of importance against redundancy)")
        if not -1 <= self.threshold <= 1:
            raise PolicySpecError(f"rkv: threshold={self.threshold} must be a cosine similarity in [-1, 1]")
        if self.adaptive:
            raise PolicySpecError("rkv: adaptive=true is not supported (its budget is one per layer); drop it")
        if self.decode_budget is not None and self.decode_budget <= self.window:
            raise PolicySpecError(f"rkv: decode_budget={self.decode_budget} must exceed window={self.window} "
                                  f"(the observation window is always kept)")

    @property
    def kept_queries(self) -> int:
        return self.window

    def scores(self, state: ScoringState) -> torch.Tensor:
        if state.queries is None:
            raise RuntimeError("rkv scores a row whose recent queries were not kept")
        keys = state.keys.float()  # [H, n, d]
        heads, n, dim = keys.shape
        queries = state.queries.float()  # [query heads, w, d]
        if queries.shape[-1] != dim or queries.shape[0] % heads:
            raise UnsupportedModelError(f"{self.spec()}: the queries ({queries.shape[0]} heads x {queries.shape[-1]}) "
                                        f"do not meet the cached keys ({heads} x {dim}) head for head (an MLA latent "
                                        f"cache); use a policy that scores the cache itself, e.g. knorm or h2o")
        logits = torch.einsum("hgqd,hnd->hgqn", queries.view(heads, -1, queries.shape[1], dim), keys) * dim ** -0.5
        logits = logits.amax(dim=1)  # [H, w, n]: the max over each KV head's query heads
        newest = state.positions.max(dim=-1, keepdim=True).values
        recent = state.positions > newest - self.window  # [H, n]: the observation window, always kept
        attention = torch.softmax(logits.masked_fill(recent[:, None, :], float("-inf")), dim=-1).nan_to_num(0.0)
        importance = attention.mean(dim=1)  # [H, n]
        if self.kernel > 1:
            importance = torch.nn.functional.max_pool1d(importance[None], self.kernel, stride=1, padding=self.kernel // 2)[0]
        scores = self.mix * importance - (1 - self.mix) * key_redundancy(keys, self.threshold)
        return scores.masked_fill(recent, float("inf"))


def key_redundancy(keys: torch.Tensor, threshold: float) -> torch.Tensor:
    """R-KV's redundancy of each key (``keys``: ``[heads, n, head_dim]``), ``[heads, n]``, each head summing to 1:
    cosine similarities (self excluded; each key's most recent neighbour above ``threshold`` spared), averaged per
    key over the others, softmax over the keys."""
    unit = keys / (keys.norm(dim=-1, keepdim=True) + 1e-8)
    similarity = unit @ unit.transpose(-1, -2)
    similarity.diagonal(dim1=-2, dim2=-1).zero_()
    slots = torch.arange(1, similarity.shape[-1] + 1, device=keys.device)
    latest = ((similarity > threshold) * slots).amax(dim=-1, keepdim=True)  # 1 + the latest similar slot; 0: none
    spared = (slots == latest) & (latest > 0)
    return similarity.masked_fill(spared, 0.0).mean(dim=-2).softmax(dim=-1)
