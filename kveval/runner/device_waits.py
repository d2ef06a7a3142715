"""Count what a forward would cost a GPU beyond its arithmetic, on any device: kernel launches and host waits.

Every aten operation that is not a view is at least one kernel launch on a GPU,
and some make a CUDA host wait for the device, because the host needs a value
the device holds (:func:`waits_for_device`). Such counts are exact and the same
on a CPU, so a cost that grows with the batch (work per row) is seen without a
GPU. :class:`OpCounter` counts them per forward of a model;
``benchmarks/op_counts.py`` prints them against transformers' own cache, and
``tests/test_device_waits.py`` keeps kveval's batches free of work per row.
"""

from __future__ import annotations

import collections

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: Operations whose result the host must read (``item``, ``int(t)``, ``bool(t)``) or whose shape depends on the data.
SYNCING = frozenset({"_local_scalar_dense", "nonzero", "masked_select", "nonzero_static"})
#: Operations that call ``nonzero`` inside when indexed by a boolean tensor.
BOOL_INDEXED = frozenset({"index", "index_put", "index_put_", "_index_put_impl_"})
#: Metadata-only operations that, like views, launch no kernel.
NO_KERNEL = frozenset({"_unsafe_view", "_reshape_alias", "lift_fresh", "set_"})


def waits_for_device(func, args) -> bool:
    """Whether ``func(*args)`` (an aten overload) makes a CUDA host wait for the device."""
    name = func.overloadpacket.__name__
    if name in SYNCING:
        return True
    indices = args[1] if name in BOOL_INDEXED and len(args) > 1 else ()
    return any(getattr(i, "dtype", None) == torch.bool for i in indices or ())


class OpCounter:
    """While active: aten operations (``ops``: kernels; ``views``), host waits (``waits``, and ``wait:NAME`` per
    kind) and host-to-device tensors (``uploads``: each ``torch.tensor`` call; on a GPU a copy from pageable host
    memory that also waits), split at each forward of ``model`` (:meth:`phases`).

    ``tolist`` is counted as a wait by a wrapper, since on a CPU it dispatches nothing. Counting runs Python for
    every operation: minutes for what takes seconds, so use small models and few tokens.
    """

    def __init__(self, model):
        self.counts: collections.Counter = collections.Counter()
        self.marks: list[collections.Counter] = []
        self._model = model

    def _count(self, func, args) -> None:
        name = func.overloadpacket.__name__
        self.counts["views" if func.is_view or name in NO_KERNEL else "ops"] += 1
        if waits_for_device(func, args):
            self.counts["waits"] += 1
            self.counts[f"wait:{name}"] += 1

    def __enter__(self) -> "OpCounter":
        counter, counts = self, self.counts
        tolist, tensor, forward = torch.Tensor.tolist, torch.tensor, self._model.forward

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                counter._count(func, args)
                return func(*args, **(kwargs or {}))

        def counted_tolist(t):
            counts["waits"] += 1
            counts["wait:tolist"] += 1
            return tolist(t)

        def counted_tensor(*args, **kwargs):
            counts["uploads"] += 1
            return tensor(*args, **kwargs)

        def marked_forward(*args, **kwargs):
            self.marks.append(collections.Counter(counts))
            return forward(*args, **kwargs)

        self._restore = (tolist, tensor, self._model.__dict__.get("forward"))  # an instance's own (accelerate's hooks)
        torch.Tensor.tolist, torch.tensor = counted_tolist, counted_tensor
        self._model.forward = marked_forward
        self._mode = Mode()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)
        torch.Tensor.tolist, torch.tensor, own_forward = self._restore
        if own_forward is None:
            del self._model.forward
        else:
            self._model.forward = own_forward
        self.marks.append(collections.Counter(self.counts))

    def phases(self) -> list[collections.Counter]:
        """The counts from each forward's start to the next one's (the last: to the end of the counting)."""
        return [later - earlier for earlier, later in zip(self.marks, self.marks[1:])]


__all__ = ["BOOL_INDEXED", "NO_KERNEL", "OpCounter", "SYNCING", "waits_for_device"]
