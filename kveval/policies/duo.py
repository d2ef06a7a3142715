"""DuoAttention-style retrieval heads: some KV heads keep everything, the others sinks plus a recent window."""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import ClassVar

from kveval.lazy import torch

from kveval.errors import PolicySpecError
from kveval.policies.base import check_calib_tokens
from kveval.policies.window import SinkWindowPolicy
from kveval.tensors.ranking import top_slots
from kveval.tensors.scoring_state import ScoringState

SCOPES = ("global", "layer")
DEFAULT_DUO_WINDOW = 64


@dataclass
class DuoPolicy(SinkWindowPolicy):
    """Retrieval and streaming heads after DuoAttention (Xiao et al. 2024, "DuoAttention: Efficient
    Long-Context LLM Inference with Retrieval and Streaming Heads").

    The fraction ``heads`` of KV heads, the model's *retrieval heads*, keep
    every token; every other KV head is a *streaming head* and keeps the first
    ``sink`` tokens plus the ``window`` most recent, at prefill and after every
    decoding step (its cache stays bounded while the retrieval heads grow).
    Heads hold different numbers of tokens and are stored apart
    (:mod:`kveval.stores.headwise`): the measured bytes are the tokens really held.

    Retrieval heads are identified once per model on generated passkey probes
    (:mod:`kveval.calibration.retrieval_heads`): the attention mass the answer's queries
    put on the needle, a cheap stand-in for DuoAttention's optimized per-head
    gates, not a reproduction of them. Sliding-window layers are never
    selected where some layer attends fully (selection does not apply to them);
    where every layer slides, their heads are ranked like any others.

    Attributes
    ----------
    heads : float
        Fraction of KV heads kept whole, ``0 <= heads <= 1``: ``0`` is
        ``streaming(sink, window)`` (or ``streaming(sink, ratio)``), ``1`` is ``none``.
    sink, window : int
        What a streaming head keeps: the first ``sink`` tokens and the ``window``
        most recent (64 unless ``ratio`` is given).
    ratio : float, optional
        Instead of ``window``, as ``streaming(ratio=...)``: a streaming head's
        prefill keeps ``ceil((1 - ratio) x n)`` of its ``n`` context tokens (the
        sinks and the most recent), then grows while decoding. The layer as a
        whole removes less than ``ratio``: its retrieval heads keep everything.
    scope : str
        ``"global"`` (default, as DuoAttention thresholds its gates over the whole
        model): the top ``ceil(heads x all KV heads)`` of the layers selection acts on,
        so layers differ in how many they keep; ``"layer"``: the top
        ``ceil(heads x kv_heads)`` in every layer.
    calib_tokens : int
        Length of the passkey probes that rank the heads.
    """

    name = "duo"
    description = "DuoAttention-style: retrieval heads keep every token, the others `sink` + the `window` most recent"
    default_window: ClassVar[int] = DEFAULT_DUO_WINDOW
    heads: float = 0.25
    sink: int = 4
    window: int | None = None
    ratio: float | None = None
    scope: str = "global"
    calib_tokens: int = 512

    per_head_budgets: ClassVar[bool] = True

    def __post_init__(self):
        if not 0 <= self.heads <= 1:
            raise PolicySpecError(f"duo: heads={self.heads} must be a fraction of KV heads, 0 <= heads <= 1")
        self.check_sink_window()  # what a streaming head keeps
        if self.scope not in SCOPES:
            raise PolicySpecError(f"duo: scope={self.scope!r} must be one of {', '.join(SCOPES)}")
        if self.calib_tokens < 64:
            raise PolicySpecError(f"duo: calib_tokens={self.calib_tokens} is too short for a passkey probe; use >= 64")
        check_calib_tokens(self.name, self.calib_tokens, None)
        self._models: dict[int, tuple[weakref.ref, torch.Tensor]] = {}  # id(model) -> (model, retrieval mask)

    @property
    def whole_head_fraction(self) -> float:
        """Share of KV heads that keep every token, as the memory planner counts it (``heads``, before rounding)."""
        return self.heads

    def choose(self, scores: torch.Tensor, keep: int, state: ScoringState, stable: bool = False) -> list[torch.Tensor]:
        retrieval = self.retrieval_mask(state.model, state.num_layers, scores.shape[0])[state.layer_idx]
        real = scores > float("-inf")
        chosen = []
        for h in range(scores.shape[0]):
            if retrieval[h]:
                chosen.append(real[h].nonzero().squeeze(1))
            else:
                count = min(keep, int(real[h].sum()))
                chosen.append(top_slots(scores[h], count, dim=0, stable=stable))
        return chosen

    def head_decode_budgets(self, model, layer_idx: int, num_layers: int, kv_heads: int) -> list[int | None] | None:
        """Retrieval heads keep every token; streaming heads ``sink + window`` (what :meth:`choose` keeps)."""
        if self.decode_budget is None:
            return None
        retrieval = self.retrieval_mask(model, num_layers, kv_heads)[layer_idx]
        return [None if bool(r) else self.decode_budget for r in retrieval]

    def retrieval_mask(self, model, num_layers: int, kv_heads: int) -> torch.Tensor:
        """``[layers, kv_heads]`` bool: which heads keep every token (calibrated once per model)."""
        if self.heads in (0, 1):  # nothing to rank
            return torch.full((num_layers, kv_heads), self.heads == 1)
        entry = self._models.get(id(model))
        if entry is not None and entry[0]() is model:
            return entry[1]
        from kveval.calibration.retrieval_heads import load_or_calibrate

        mask = load_or_calibrate(model, self.calib_tokens).retrieval_mask(self.heads, self.scope)
        self._models[id(model)] = (weakref.ref(model), mask)
        return mask

    def retrieval_fraction(self, model) -> float:
        """Share of all KV heads kept whole on ``model`` (what ``heads`` gives after rounding; layers selection skips count as streaming)."""
        config = model.config.get_text_config()
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        mask = self.retrieval_mask(model, config.num_hidden_layers, kv_heads)
        return float(mask.float().mean())


__all__ = ["DuoPolicy"]
