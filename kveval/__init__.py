"""kveval: what do I lose if I compress the KV cache this way?

The Python API (``docs/python-api.md``). ``import kveval`` is cheap and loads no torch: each name below is a lazy
attribute, imported on first use from the module that defines it (:data:`API`).

``kveval.load_model(name="smollm2-135m", device="auto", dtype="auto", ...)``
    A causal LM and its tokenizer, ready for compressed caches: an embedded model, a Hub id, a folder or a
    ``.gguf`` file (:func:`kveval.runner.models.load_model`).
``kveval.parse_policy(spec)``
    A policy spec such as ``"snapkv(ratio=0.5)+kivi(bits=4)"``, parsed and checked (:func:`kveval.policies.spec.parse_policy`).
``kveval.generate(model, tokenizer, prompt, question="", policy="none", ...)``
    Greedy generation under a policy: the answer and the measured cache bytes (:func:`kveval.api.generate`).
``kveval.evaluate(model, policies, out, ...)``
    Probe items, generated or given, under policies (the baseline added), into run folders (:func:`kveval.api.evaluate`).
``kveval.gate(baseline, candidates, config="default")``
    Each candidate run's verdict against its baseline: runs -> verdicts (:func:`kveval.gate.gate`; ``kveval.gate``
    is the gate's package, made callable).
``kveval.plan(model, context, batch=1, policy=None, ...)``
    The KV-cache memory plan, from the model's config alone (:func:`kveval.api.plan`).
"""

import importlib

__version__ = "0.1.0"

#: The lazy attributes of the Python API: name -> the module that defines it.
API = {"load_model": "kveval.api", "parse_policy": "kveval.api", "generate": "kveval.api", "evaluate": "kveval.api",
       "gate": "kveval.gate", "plan": "kveval.api"}

__all__ = ["__version__", *API]


def __getattr__(name: str):
    """Import an API name's module on its first read (:data:`API`); ``kveval.gate`` is the callable package."""
    if name not in API:
        raise AttributeError(f"module 'kveval' has no attribute {name!r}")
    module = importlib.import_module(API[name])
    value = module if name == "gate" else getattr(module, name)
    globals()[name] = value  # later reads are plain attribute reads
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *API})
