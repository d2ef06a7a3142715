"""kveval's Python API, the functions ``import kveval`` offers (``docs/python-api.md``).

``kveval/__init__.py`` exposes them as lazy attributes (``kveval.load_model``, ...), so ``import kveval`` stays cheap
and torch-free; they live here, above both halves, because they join them: the engine's models, policies,
generation and planner, and the analysis's gate. What a user writes (policy specs, probe settings) is parsed once,
here at the edge, and handed down as typed objects.

- :func:`load_model` and :func:`parse_policy`: the engine's own (:mod:`kveval.runner.models`,
  :mod:`kveval.policies.spec`);
- :func:`generate`: text in, the answer and the measured cache bytes out;
- :func:`evaluate`: probe items (generated, or given) under policies, one run folder each, as ``kveval eval``;
- :func:`plan`: the memory planner's plan of a model, a context, a batch and a policy, from its config alone;
- ``kveval.gate`` (runs -> verdicts) is the gate's package, callable: :func:`kveval.gate.gate`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Sequence

from kveval.errors import UsageError
from kveval.planner.layouts import MemoryPlan
from kveval.planner.memory import plan as plan_memory
from kveval.policies.base import PolicyStack
from kveval.policies.spec import parse_policy
from kveval.probes import resolve_families
from kveval.probes.item import ProbeItem, read_probe_items
from kveval.probes.sets import ProbeSet
from kveval.runner import generation
from kveval.runner.evaluate import evaluate_policies
from kveval.runner.generation import GenerationResult, encode_prompt
from kveval.runner.models import load_model
from kveval.runner.runspec import RunSpec, check_lengths, parse_run_specs
from kveval.runs.ownership import refuse_sweep_folder


def generate(model, tokenizer, prompt: str | Sequence[str], question: str = "",
             policy: str | PolicyStack | RunSpec = "none", *, mode: str | None = None, max_new_tokens: int = 48,
             kv_dtype: str | None = None, chat: bool | None = None, batch_size: int = 1,
             seed: int = 0) -> GenerationResult | list[GenerationResult]:
    """Greedy generation under a compression policy, as ``kveval generate`` does: the answer and the cache's bytes.

    Parameters
    ----------
    model, tokenizer
        From :func:`load_model`.
    prompt
        The context as text, or a list of them (answered as a batch; the answers do not depend on it).
    question
        Text appended to every prompt: after compression (``mode="context"``, the default: query-agnostic, as a
        cached prefix is in deployment) or compressed with it in view (``mode="query"``).
    policy
        A policy spec (``"snapkv(ratio=0.5)+kivi(bits=4)"``, an optional ``@query`` suffix), or a parsed one.
    max_new_tokens, kv_dtype, chat, batch_size, seed
        Most tokens generated; the deployment's cache dtype (default the checkpoint's); whether to apply the chat
        template (default: when the tokenizer has one); rows per forward pass; the ``random`` policy's seed.

    Returns
    -------
    GenerationResult, or a list of them for a list of prompts
        ``text``, ``token_ids``, ``logprobs``, ``stats`` (measured ``kv_bytes``, the uncompressed cache's
        ``nominal_bytes``, their ``ratio``; ``stats.summary()`` says it in a line) and the timings.
    """
    spec = (policy if isinstance(policy, RunSpec) else RunSpec.parse(policy, mode=mode, kv_dtype=kv_dtype)).for_model(model)
    texts = [prompt] if isinstance(prompt, str) else list(prompt)
    prompts = [encode_prompt(tokenizer, text, question, chat=chat) for text in texts]
    results = generation.generate(model, tokenizer, prompts, spec.policy, max_new_tokens=max_new_tokens,
                                  batch_size=batch_size, seed=seed, **spec.generation_kwargs())
    return results[0] if isinstance(prompt, str) else results


def evaluate(model, policies: str | Sequence[str], out: str | os.PathLike, *, tokenizer=None,
             items: Sequence[ProbeItem] | str | os.PathLike | None = None, families: Sequence[str] = ("passkey",),
             lengths: Sequence[int] = (512,), n: int = 10, depths: Sequence[float] | None = None, seed: int = 0,
             baseline: bool = True, mode: str | None = None, kv_dtype: str | None = None, batch_size: int = 1,
             fidelity: bool = False) -> list[Path]:
    """Run probe items under each policy and write one run folder per policy, as ``kveval eval`` does.

    Parameters
    ----------
    model
        A model name (``"smollm2-135m"``, a Hub id, a folder or a ``.gguf`` path: loaded here), or a model from
        :func:`load_model` (then give ``tokenizer`` too).
    policies
        One policy spec or several; ``baseline=True`` (the default) adds ``none`` first, which :func:`kveval.gate`
        and ``kveval compare`` judge the others against.
    out
        A folder: runs go to ``out/runs/<model>/<policy>``. A run that was stopped resumes where it stopped.
    items
        The items: :class:`~kveval.probes.item.ProbeItem` objects, or the path of a ``kveval probes`` file. Default:
        generated from ``families`` (or ``["all"]``), ``lengths`` (tokens), ``n`` per family and length, ``depths``
        and ``seed``; the run folders then record that set, so ``kveval rescore`` can score them again.
    mode, kv_dtype, batch_size, fidelity
        As ``kveval eval``'s ``--mode``, ``--kv-dtype``, ``--batch-size`` and ``--fidelity``.

    Returns
    -------
    list of Path
        The run folders, in the order of the policies (the baseline first).
    """
    refuse_sweep_folder(Path(out), "evaluate", "give out a new folder")  # before anything loads
    names = [policies] if isinstance(policies, str) else list(policies)
    if isinstance(model, str):
        name = model
    else:
        name = getattr(model, "kveval_name", None)
        if name is None or tokenizer is None:
            raise UsageError("evaluate: give a model name, or a model loaded with kveval.load_model and its tokenizer=")
    specs = parse_run_specs((["none"] if baseline else []) + names, name, mode=mode, kv_dtype=kv_dtype)
    extra = None
    if items is None:
        check_lengths(name, list(lengths), "lengths")
        probe_set = ProbeSet(tokenizer=name, families=resolve_families(list(families)), lengths=list(lengths), n=n,
                             depths=None if depths is None else list(depths), seed=seed)
        extra = {"probe_sets": [probe_set.to_dict()]}  # kveval rescore generates the items again from it
    elif isinstance(items, (str, os.PathLike)):
        items = read_probe_items(items)
    if isinstance(model, str):
        model, tokenizer = load_model(name)
    if items is None:
        items = probe_set.items(tokenizer)
    return evaluate_policies(model, tokenizer, list(items), specs, Path(out), name, batch_size, seed,
                             fidelity=fidelity, extra=extra)


def plan(model, context: int, batch: int = 1, policy: str | PolicyStack | None = None, **options) -> MemoryPlan:
    """The KV-cache memory plan, as ``kveval memory`` prints it, from the model's config alone (no weights load).

    Parameters
    ----------
    model
        A preset (``"llama-3.1-8b"``; ``kveval memory --list``), a ``config.json`` or its folder, a Hub id, a mapping
        or a ``PretrainedConfig``.
    context, batch
        Tokens per sequence and sequences.
    policy
        A policy spec or a parsed one (default: the uncompressed cache).
    **options
        The planner's own (:func:`kveval.planner.memory.plan`): ``dtype_bytes``, ``new_tokens``, ``storage``,
        ``achieved_ratio``.

    Returns
    -------
    MemoryPlan
        ``bytes_per_token``, ``sequence_bytes``, ``total_bytes`` and the uncompressed cache's
        (``baseline_bytes_per_token``, ``baseline_total_bytes``), per layer in ``layers``, with ``notes``;
        :func:`kveval.planner.memory.format_plan` prints it as ``kveval memory`` does.
    """
    return plan_memory(model, context, batch, parse_policy(policy) if isinstance(policy, str) else policy, **options)


__all__ = ["evaluate", "generate", "load_model", "parse_policy", "plan"]
