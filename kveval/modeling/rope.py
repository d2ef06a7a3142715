"""The rotary embedding (RoPE) each model applies to its keys, as kveval reads it.

:class:`RopeHook` (:func:`rope_hook`) rotates keys as the model does and undoes it exactly, so keys can be
quantized before RoPE (:mod:`kveval.stores.kvquant`) and scored by expected attention. :class:`RopeSwitch`
(:func:`rope_switches`) names the RoPE variants whose angles depend on the sequence length (dynamic NTK, Phi-3's
LongRoPE): :func:`check_rope_batch` refuses a batch whose rows would see other angles than alone.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from kveval.errors import UnsupportedModelError
from kveval.modeling.architectures import architecture_name

#: ``model_type`` values whose attention rotates keys as ``k * cos + rotate_half(k) * sin`` on the first
#: ``cos.shape[-1]`` channels (partial rotary: the rest pass through), with ``cos, sin`` from the decoder's
#: ``rotary_emb(x, position_ids[, layer_type])``. Checked against each model's own keys by tests/test_kvquant.py.
ROTATE_HALF_ROPE = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "phi3",
                              "gemma", "gemma2", "gemma3", "gemma3_text"})


class RopeHook:
    """One attention layer's rotary embedding, as the model applies it to keys, and its exact inverse.

    ``rotate(x, positions)`` is what the model does to a pre-RoPE key at
    ``positions``; ``unrotate`` undoes it (the per-pair rotation matrix is
    inverted exactly, also when a RoPE variant scales cos and sin). ``x`` is
    ``[H, T, D]``, ``positions`` ``[H, T]`` (int64); both return float32.
    cos/sin are computed in float32 by the model's own rotary module, memoized
    per position (the module is deterministic for the static RoPE types).
    """

    def __init__(self, rotary, layer_type: str | None):
        import inspect

        self.rotary, self.layer_type = rotary, layer_type
        self._takes_layer_type = "layer_type" in inspect.signature(rotary.forward).parameters
        rope_type = getattr(rotary, "rope_type", "default")
        rope_type = rope_type.get(layer_type, "default") if isinstance(rope_type, dict) else rope_type
        #: Dynamic NTK and longrope change every angle once a forward's positions pass a length of their own (the
        #: model's original context): positions below it, the only ones the table then holds, else ``None``.
        self.static_positions = _static_rope_positions(rotary, str(rope_type), layer_type if self._takes_layer_type else None)
        self._rope_type = rope_type
        self._cos: torch.Tensor | None = None  # [P, rot_dim] float32 for positions 0 .. P-1
        self._sin: torch.Tensor | None = None

    def cos_sin(self, positions: torch.Tensor, bound: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` of shape ``[*positions.shape, rot_dim]`` (float32, on ``positions``' device).

        ``bound``: a number above every position, where the caller knows one on the host (the table then grows
        without reading the largest position from the device, a wait per call on a GPU).

        A RoPE whose angles change with the length (:attr:`static_positions`) gets a table of the angles below
        that length only, made as the model makes them there; a position past it is refused
        (:class:`~kveval.errors.UnsupportedModelError`): past it the angles depend on each forward's length
        (longrope's long factors, dynamic NTK's grown base), and a stored key re-rotated when read would need the
        angles of its own forward, which the hook does not track. A bound past that length is checked by reading."""
        limit = self.static_positions
        if bound is not None and (limit is None or bound <= limit):
            needed = bound
        else:
            needed = int(positions.max()) + 1 if positions.numel() else 0
        if limit is not None and needed > limit:
            raise UnsupportedModelError(
                f"keys quantized before RoPE are re-rotated at angles known up to {limit} positions, where "
                f"{self._rope_type} RoPE turns to angles that depend on each forward's length, which kveval does "
                f"not track: use pre_rope=false, or rows of at most {limit} tokens")
        if self._cos is None or self._cos.shape[0] < needed or self._cos.device != positions.device:
            size = max(needed, 2 * (0 if self._cos is None else self._cos.shape[0]), 256)
            size = size if limit is None else min(size, limit)  # past it, the module would turn to other angles
            self._cos, self._sin = self.one_forward_cos_sin(size, positions.device)
        return self._cos[positions], self._sin[positions]

    def one_forward_cos_sin(self, length: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """``cos, sin`` ``[length, rot_dim]`` (float32) of positions ``0 .. length - 1`` as the model turns them in
        one forward over them: what a calibration pass of ``length`` tokens used, whatever the RoPE."""
        cos, sin = _rotary_angles(self.rotary, torch.arange(length, device=device)[None],
                                  self.layer_type if self._takes_layer_type else None)
        return cos[0].float(), sin[0].float()

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat([-x[..., half:], x[..., :half]], dim=-1)

    def rotate(self, x: torch.Tensor, positions: torch.Tensor, cos_sin=None) -> torch.Tensor:
        """``x`` rotated at ``positions``; ``cos_sin``: :meth:`cos_sin` of ``positions`` when the caller has it."""
        cos, sin = cos_sin or self.cos_sin(positions)
        x = x.float()
        r = cos.shape[-1]
        turned = x[..., :r] * cos + self._rotate_half(x[..., :r]) * sin
        return turned if r == x.shape[-1] else torch.cat([turned, x[..., r:]], dim=-1)

    def unrotate(self, x: torch.Tensor, positions: torch.Tensor, cos_sin=None) -> torch.Tensor:
        """The inverse of :meth:`rotate`; ``cos_sin`` likewise."""
        cos, sin = cos_sin or self.cos_sin(positions)
        x = x.float()
        r = cos.shape[-1]
        back = (x[..., :r] * cos - self._rotate_half(x[..., :r]) * sin) / (cos * cos + sin * sin)
        return back if r == x.shape[-1] else torch.cat([back, x[..., r:]], dim=-1)


def _rotary_angles(rotary, ids: torch.Tensor, layer_type: str | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's rotary module called as its decoder calls it, for position ids ``ids`` (``[1, n]``): ``cos, sin``
    (its own dtype), and whatever state its RoPE type updates on the way (longrope's factors, dynamic NTK's base)."""
    probe = torch.zeros(1, dtype=torch.float32, device=ids.device)
    with torch.no_grad():
        return rotary(probe, ids) if layer_type is None else rotary(probe, ids, layer_type)


def _decoder_rotary(model):
    """The decoder's shared rotary module (``rotary_emb``), or ``None``."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    return getattr(decoder, "rotary_emb", None)


def _static_rope_positions(rotary, rope_type: str, layer_type: str | None) -> int | None:
    """The positions below which a length-dependent RoPE keeps its angles, as transformers'
    ``dynamic_rope_update`` decides: longrope turns to its long factors once a forward's length passes
    ``original_max_position_embeddings``; dynamic NTK grows its base once it passes the module's original
    ``max_seq_len_cached``. ``None`` for a RoPE whose angles do not depend on the length."""
    if rope_type == "longrope":
        parameters = rotary.config.rope_parameters
        return int((parameters[layer_type] if layer_type is not None else parameters)["original_max_position_embeddings"])
    if "dynamic" in rope_type:
        return int(rotary.original_max_seq_len)
    return None


@dataclass(frozen=True)
class RopeSwitch:
    """A RoPE of a model's decoder whose angles change once a forward's length (its largest position + 1, over
    every row) passes ``positions``: longrope turns to its long factors, dynamic NTK grows its base to that
    length. transformers makes the choice once per forward, for every row of the batch."""

    kind: str
    positions: int
    rotary: torch.nn.Module
    layer_type: str | None

    @property
    def dynamic(self) -> bool:
        """Past the switch the angles depend on the length itself (dynamic NTK), not only on which side it is."""
        return "dynamic" in self.kind

    def agrees(self, lengths: list[int], longest: int) -> bool:
        """Whether rows of ``lengths`` (tokens once the forward is in) get, in a forward whose longest row has
        ``longest``, the angles each gets alone: all under the switch, or all past a longrope's, or all of the
        longest's length past a dynamic NTK's."""
        if longest <= self.positions:
            return True
        return all(n > self.positions and (not self.dynamic or n == longest) for n in lengths)

    def crosses(self, before: int, after: int) -> bool:
        """Whether a row growing from ``before`` tokens (at least one) to ``after`` in a later forward crosses a
        longrope's switch. Its earlier keys then keep the short factors and its later ones get the long, where
        transformers' own generation for Phi-3 recomputes the whole cache with the long factors at that point:
        kveval reproduces neither, so such a row is refused. Dynamic NTK's mix of bases is what transformers keeps
        too, and what kveval's rows keep."""
        return not self.dynamic and 0 < before <= self.positions < after

    def refusal(self, shortest: int, longest: int) -> UnsupportedModelError:
        return UnsupportedModelError(
            f"a batch of rows {shortest} to {longest} tokens long meets {self.kind} RoPE's switch at "
            f"{self.positions} positions, where transformers turns every row of a forward by the longest row's "
            f"angles, so a row would not get the tokens it gets alone: use batch_size=1")

    def crossing(self, before: int, after: int) -> UnsupportedModelError:
        return UnsupportedModelError(
            f"a row grows from {before} to {after} tokens across {self.kind} RoPE's switch at {self.positions} "
            f"positions, after which its keys turn by other factors than before (transformers' generate "
            f"recomputes the whole cache there), which kveval does not reproduce: keep prompt + max_new_tokens "
            f"within {self.positions} tokens, or the first forward (the context) past it")


_ROPE_SWITCHES: "weakref.WeakKeyDictionary[torch.nn.Module, tuple[RopeSwitch, ...]]" = weakref.WeakKeyDictionary()


def rope_switches(model) -> tuple[RopeSwitch, ...]:
    """The :class:`RopeSwitch` of each RoPE of ``model``'s decoder whose angles change with the length
    (:func:`_static_rope_positions`); empty for every other model."""
    if model not in _ROPE_SWITCHES:
        rotary = _decoder_rotary(model)
        rope_type = getattr(rotary, "rope_type", "default")
        kinds = rope_type.items() if isinstance(rope_type, dict) else [(None, rope_type)]
        switches = []
        for layer_type, kind in kinds:
            limit = None if rotary is None else _static_rope_positions(rotary, str(kind), layer_type)
            if limit is not None:
                switches.append(RopeSwitch(str(kind), limit, rotary, layer_type))
        _ROPE_SWITCHES[model] = tuple(switches)
    return _ROPE_SWITCHES[model]


def check_rope_batch(model, seen: list[int], lengths: list[int], active: list[bool]) -> None:
    """Refuse a forward a length-dependent RoPE would turn otherwise than transformers turns each row alone:
    a row crossing a longrope's switch after its first forward (:meth:`RopeSwitch.crosses`), or, in a batch, rows
    the forward's one choice of angles does not suit (:meth:`RopeSwitch.agrees`). ``seen``: each row's tokens
    before the forward; ``lengths``: after it, which set the longest position transformers sees, finished rows'
    too; ``active``: rows with tokens in it."""
    switches = rope_switches(model)
    if not switches:
        return
    longest = max(lengths)
    own = [n for n, on in zip(lengths, active) if on]
    for switch in switches:
        for before, after, on in zip(seen, lengths, active):
            if on and switch.crosses(before, after):
                raise switch.crossing(before, after)
        if len(lengths) > 1 and not switch.agrees(own, longest):
            raise switch.refusal(min(own), longest)


def reset_rope_lengths(model) -> None:
    """Give a dynamic NTK RoPE back the base it was loaded with. transformers keeps the base its longest forward
    grew it to, and resets it only for a forward shorter than the original length, so a batch's angles would
    depend on the batches run before it. One call of the rotary module at position 0 takes that reset (the
    module's own code); longrope keeps no such state."""
    for switch in rope_switches(model):
        if switch.dynamic:
            device = next((b.device for b in switch.rotary.buffers()), torch.device("cpu"))
            _rotary_angles(switch.rotary, torch.zeros(1, 1, dtype=torch.long, device=device), switch.layer_type)


def rope_hook(model, layer_idx: int) -> RopeHook:
    """The :class:`RopeHook` of attention layer ``layer_idx``; :class:`UnsupportedModelError` where kveval has none.

    Llama-family models keep one ``rotary_emb`` on the decoder; Gemma 3 keeps one
    per layer type (local and global RoPE bases), chosen by ``config.layer_types``.
    """
    config = model.config.get_text_config(decoder=True)
    model_type = getattr(config, "model_type", None)
    rotary = _decoder_rotary(model)
    if model_type not in ROTATE_HALF_ROPE or rotary is None:
        raise UnsupportedModelError(
            f"{architecture_name(model.config)}: kveval has no RoPE hook for model_type {model_type!r} (known: "
            f"{', '.join(sorted(ROTATE_HALF_ROPE))}), so keys cannot be quantized before RoPE; use pre_rope=false")
    layer_types = getattr(config, "layer_types", None)
    return RopeHook(rotary, layer_types[layer_idx] if layer_types else None)


__all__ = ["ROTATE_HALF_ROPE", "RopeHook", "RopeSwitch", "check_rope_batch", "reset_rope_lengths", "rope_hook", "rope_switches"]
