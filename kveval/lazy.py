"""``torch``, imported on first use: what lets a module that computes on tensors be imported without torch.

The analysis commands (gate, compare, report, rescore, the memory planner) parse and plan policies but never run
one, and they load no torch: a policy module writes ``from kveval.lazy import torch`` instead of ``import torch``.
The first attribute read (``torch.where``, ``torch.Tensor``) imports the real module and copies its namespace into
this one, so later reads cost what a plain module's do. Annotations stay strings (``from __future__ import
annotations``), and nothing may touch ``torch`` while its module is being imported (a default argument such as
``dtype=torch.float32`` would load it there).
"""

from __future__ import annotations

import importlib
import types


class LazyModule(types.ModuleType):
    """A stand-in for the module ``name`` that imports it on the first attribute read."""

    def __init__(self, name: str):
        super().__init__(name)
        self.__dict__["_lazy_name"] = name

    def __getattr__(self, attr: str):
        module = importlib.import_module(self.__dict__["_lazy_name"])
        self.__dict__.update(module.__dict__)  # from now on a plain dictionary read, as on the module itself
        return getattr(module, attr)

    def __repr__(self) -> str:
        return f"<lazy module {self.__dict__['_lazy_name']!r}>"


torch = LazyModule("torch")

__all__ = ["LazyModule", "torch"]
