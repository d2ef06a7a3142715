"""A set of probe items as its arguments name it: families x lengths, ``n`` contexts each, depths, seed, params.

Items are deterministic for these arguments and a tokenizer, so a run records the set instead of its items, and
the items can be generated again later (``kveval rescore`` scores stored answers against them). ``kveval eval``
records its set in each run's ``run.json`` (``extra.probe_sets``); a sweep's config is its set.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from kveval.errors import ResultFileError
from kveval.probes.families import generate_items


@dataclass(frozen=True)
class ProbeSet:
    """The arguments of :func:`~kveval.probes.generate_items`, for every family and length.

    Attributes
    ----------
    tokenizer : str
        The model whose tokenizer counts the tokens (a name for :func:`kveval.modeling.sources.load_tokenizer`).
    families : list of str
    lengths : list of int
        Prompt lengths in tokens.
    n : int
        Contexts per family and length.
    depths : list of float or None
        Needle depths, cycled over items (``None``: the default depths).
    seed : int
    params : dict
        Family name -> its parameters (``{"niah_single": {"value_kind": "uuid"}}``).
    """

    tokenizer: str
    families: list[str]
    lengths: list[int]
    n: int
    depths: list[float] | None = None
    seed: int = 0
    params: dict[str, dict[str, Any]] = field(default_factory=dict)

    def items(self, tokenizer) -> list:
        """Every item of the set, family by family and length by length, counted with ``tokenizer`` (that of
        :attr:`tokenizer`, loaded by the caller: probes never load a model's files themselves)."""
        out = []
        for family in self.families:
            for length in self.lengths:
                out += generate_items(family, tokenizer, length, self.n, depths=self.depths, seed=self.seed,
                                      **self.params.get(family, {}))
        return out

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data, where: str) -> "ProbeSet":
        """Read a recorded set back (``where`` names the file in a refusal)."""
        try:
            probe_set = cls(**data)
        except TypeError:
            raise ResultFileError(f"{where}: a recorded probe set is not one kveval writes ({data!r})") from None
        if not (isinstance(probe_set.tokenizer, str) and isinstance(probe_set.families, list)
                and isinstance(probe_set.lengths, list) and isinstance(probe_set.n, int)):
            raise ResultFileError(f"{where}: a recorded probe set is not one kveval writes ({data!r})")
        return probe_set


__all__ = ["ProbeSet"]
