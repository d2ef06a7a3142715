"""The eval runner: probe items under one or more policies, one run folder per policy (the command: :mod:`kveval.commands.eval`).

Each run folder holds ``run.json`` and ``items.jsonl`` (see :mod:`kveval.runs.records`).
Items already in a run's ``items.jsonl`` are skipped, so an interrupted
evaluation continues where it stopped. All policies of a call share one
prefill per batch of items (:func:`kveval.runner.generation.generate_each`); each
policy's items are written as soon as that policy has decoded them, so a run
killed between two policies of one prefill reruns only the policies it had not
written.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from kveval.dtypes import deployment_dtype_name
from kveval.errors import PolicySpecError, RunFolderError, UsageError
from kveval.probes import encode_item, score_answer
from kveval.runner.fidelity import record_fidelity
from kveval.runner import generation  # generation.generate_each, looked up when called (tests stand a spy in)
from kveval.runner.generation import Prompt, check_batch_size, check_request, forward_batch_size
from kveval.runner.runspec import RunSpec, model_folder, model_identity, recorded_policy, run_dir_for
from kveval.runs.records import (
    ItemRecord,
    ItemWriter,
    RunInfo,
    cut_partial_item,
    is_probe_record,
    iter_items,
    read_run_info,
    write_run_info,
)


def _record(item, result, score) -> ItemRecord:
    stats = result.stats
    return ItemRecord(
        id=item.id, hash=item.hash, task=item.family, score=score.score, correct=score.correct, category=score.category,
        answer=result.text, gold=list(item.gold), recalled=score.recalled, length=item.length, depth=item.depth,
        metrics={"kv_bytes": stats.kv_bytes, "nominal_bytes": stats.nominal_bytes, "index_bytes": stats.index_bytes,
                 "bytes_per_token": stats.bytes_per_token, "nominal_bytes_per_token": stats.nominal_bytes_per_token,
                 "kept_tokens_mean": statistics.fmean(k[0] for k in stats.kept_tokens), "tokens_seen": stats.tokens_seen[0],
                 "ttft_s": result.prefill_seconds, "decode_tokens_per_s": result.decode_tokens_per_second,
                 "group": item.group, "turn": item.turn, "needle_kept": result.watched_kept,
                 "achieved_ratio": 1.0 - stats.ratio, **prefix_metrics(result),
                 "peak_kv_bytes": result.peak_kv_bytes, "new_tokens": len(result.token_ids),
                 **({"parts": stats.parts, "state_bytes": stats.state_bytes} if stats.parts else {})},
    )


def prefix_metrics(result) -> dict:
    """``context`` mode: the compressed context's bytes (``prefix_kv_bytes``, measured before the question) and
    what the item's request added to them (``request_kv_bytes``: ``kv_bytes`` less the prefix; its question and
    answer tokens, and what it changed in the prefix: tokens a decode budget evicted, so it may be negative, or a
    residual quantized as its tokens arrived). Items sharing one
    context (one ``group``) record the same prefix: :func:`shared_prefix_bytes` counts it once. Empty in
    ``query`` mode, where the question is compressed with the context."""
    if result.prefix_stats is None:
        return {}
    prefix = result.prefix_stats.kv_bytes
    return {"prefix_kv_bytes": prefix, "request_kv_bytes": result.stats.kv_bytes - prefix}


def _run_stack(info: RunInfo):
    """The run's policy (:func:`~kveval.runner.runspec.recorded_policy`), read once for what finalizing asks of it;
    ``None`` for a policy registered in the process that ran it, not in this one (then none of kveval's rules below
    apply to it)."""
    try:
        return recorded_policy(info)
    except PolicySpecError:
        return None


def prefix_changed_per_request(stack) -> str | None:
    """Why a run's requests cannot hold their prompt's compressed prefix once (each changes its own copy of it), or
    ``None`` when they can: a decode budget evicts prefix tokens in each request's copy; a full-precision residual
    window (KIVI's) has each request's tokens push the prefix's newest tokens into codes. ``stack``: the run's
    policy (:func:`_run_stack`; ``None``: counted as shareable)."""
    if stack is None:
        return None
    if stack.selection is not None and stack.selection.decode_budget is not None:
        return "a decode budget evicts prefix tokens in each request's copy"
    representation = stack.quantization
    if representation is not None and representation.residual_tokens:
        return "each request's tokens push the prefix's full-precision residual tokens into codes in its own copy"
    return None


def shared_prefix_bytes(records: list, stack=None) -> dict | None:
    """Cache bytes of the run's shared prefixes, each counted once (``run.json``'s ``extra["shared_prefix"]``).

    A shared prefix is a context that several items' requests continue from: a ``group`` of more than one
    item with :func:`prefix_metrics` (``system_rules``: one system prompt; ``multi_turn``: one context). A
    group's bytes are its prefix once plus each request's own: ``prefix_kv_bytes + sum(request_kv_bytes)``, what
    a server holding the compressed prompt once and one cache per request would hold with every request in.

    Returns ``None`` when no group shares, else ``groups`` and ``requests`` (items in them), the means over
    groups of ``prefix_kv_bytes`` and ``group_kv_bytes``, ``kv_bytes_per_request`` (all groups' bytes over their
    requests: the prefix amortized) and ``unshared_kv_bytes_per_request`` (the mean ``kv_bytes`` of those items:
    each request holding a copy of the prefix, the per-row figure every other byte count in a run uses).

    Where each request changes its copy of the prefix under ``stack`` (:func:`prefix_changed_per_request`), no
    server can hold it once: ``held_once`` is false, ``not_held_once`` says why, and a group's bytes are its
    requests' own caches, ``sum(kv_bytes)`` (the shared figures equal the unshared ones).
    """
    groups: dict[str, list] = {}
    for r in records:
        if "prefix_kv_bytes" in r.metrics:
            groups.setdefault(r.metrics["group"], []).append(r)
    shared = [g for g in groups.values() if len(g) > 1]
    if not shared:
        return None
    prefixes = [g[0].metrics["prefix_kv_bytes"] for g in shared]  # the same for every item of a group
    why = prefix_changed_per_request(stack)
    if why is None:
        totals = [p + sum(r.metrics["request_kv_bytes"] for r in g) for p, g in zip(prefixes, shared)]
    else:
        totals = [sum(r.metrics["kv_bytes"] for r in g) for g in shared]
    requests = sum(len(g) for g in shared)
    out = {"groups": len(shared), "requests": requests, "prefix_kv_bytes_mean": statistics.fmean(prefixes),
           "group_kv_bytes_mean": statistics.fmean(totals), "kv_bytes_per_request": sum(totals) / requests,
           "unshared_kv_bytes_per_request": statistics.fmean(r.metrics["kv_bytes"] for g in shared for r in g),
           "held_once": why is None}
    if why is not None:
        out["not_held_once"] = why
    return out


def target_spans(item) -> tuple[tuple[int, int], ...]:
    """The token spans of ``item``'s target needles (what :func:`_record` reports as ``needle_kept``)."""
    return tuple(n.span for n in item.needles if n.role == "target" and n.span[1] > n.span[0])


def _reaches_ratio_per_item(stack) -> bool:
    """Whether the run's policy (:func:`_run_stack`) keeps what clears a threshold, so the ratio it removes differs
    per item (:mod:`kveval.policies.threshold`)."""
    return stack is not None and stack.selection is not None and stack.selection.thresholded


def finalize_run(run_dir: Path) -> RunInfo:
    """Write the run's measured averages (bytes per token, speed) into ``run.json``."""
    info = read_run_info(run_dir)
    records = [r for r in iter_items(run_dir) if is_probe_record(r)]  # lm-eval's samples measure no cache
    if records:
        info.bytes_per_token = statistics.fmean(r.metrics["bytes_per_token"] for r in records)
        info.nominal_bytes_per_token = statistics.fmean(r.metrics["nominal_bytes_per_token"] for r in records)
        info.extra.update({
            "items": len(records),
            "peak_kv_bytes": max(r.metrics["kv_bytes"] for r in records),
            "ttft_s_mean": statistics.fmean(r.metrics["ttft_s"] for r in records),
            "decode_tokens_per_s_mean": statistics.fmean(r.metrics["decode_tokens_per_s"] for r in records),
        })
        ratios = [r.metrics["achieved_ratio"] for r in records if r.metrics.get("achieved_ratio") is not None]
        stack = _run_stack(info)
        if ratios and _reaches_ratio_per_item(stack):
            info.extra["achieved_ratio"] = {"mean": statistics.fmean(ratios), "min": min(ratios), "max": max(ratios)}
        shared = shared_prefix_bytes(records, stack)
        if shared:
            info.extra["shared_prefix"] = shared
        parted = [r for r in records if r.metrics.get("parts")]
        if parted:  # DeepSeek V3.2/V4: each part's bytes per token, and the constant-size state (kveval.cache.native_layers)
            names = list(dict.fromkeys(name for r in parted for name in r.metrics["parts"]))
            info.extra["parts_bytes_per_token"] = {
                name: statistics.fmean(r.metrics["parts"].get(name, 0) / max(1, r.metrics["tokens_seen"]) for r in parted)
                for name in names}
            info.extra["state_bytes_mean"] = statistics.fmean(r.metrics.get("state_bytes", 0) for r in parted)
    write_run_info(run_dir, info)
    return info


def evaluate_policies(model, tokenizer, items: list, policies: "list[RunSpec]", root: Path, model_name: str,
                      batch_size: int = 1, seed: int = 0, progress=None, extra: dict | None = None,
                      revision: str | None = None, fidelity: bool = False) -> list[Path]:
    """Evaluate ``items`` under every policy; return the run folders (one per policy, same order).

    Parameters
    ----------
    policies : list of RunSpec
        Run specs, parsed at the edge. All must share one mode and KV dtype (one call per mode).
    progress : tqdm-like, optional
        ``update(n)`` is called once per finished (item, policy) pair.
    extra : dict, optional
        Recorded in each ``run.json`` (e.g. the sweep's config hash).
    revision : str, optional
        The model's Hub revision, part of its identity.
    fidelity : bool, optional
        Also teacher-force the baseline's answers through each compressed
        policy and write ``fidelity.jsonl`` into its run folder
        (:mod:`kveval.runner.fidelity`); needs ``none`` among ``policies``. Costs
        about one extra generation per item and policy, plus one for the baseline.

    Raises
    ------
    RunFolderError
        A run folder to resume holds another model (identity) or other prompts
        under the same item ids.
    """
    check_batch_size(batch_size)  # before any run folder opens
    batch_size = forward_batch_size(model, batch_size)
    if not all(isinstance(p, RunSpec) for p in policies):
        raise TypeError("evaluate_policies takes RunSpecs; parse specs at the edge with RunSpec.parse")
    specs = list(policies)
    specs = [s.for_model(model) for s in specs]
    if len({(s.mode, s.kv_dtype) for s in specs}) > 1:
        raise ValueError("evaluate_policies: give policies of one mode and KV dtype per call")
    identity = model_identity(model_name, revision)
    stacks = [s.policy for s in specs]
    dirs = [_open_run(run_dir_for(root, identity, s), s, model, model_name, identity, items, extra) for s in specs]
    writers = [ItemWriter(d) for d in dirs]  # opening cuts off a half-written last line
    try:
        done = [{r.id for r in iter_items(d)} for d in dirs]
        if progress is not None:
            progress.update(sum(item.id in finished for finished in done for item in items))
        for needed, batch in _pending_batches(items, done, batch_size):
            prompts = [Prompt(*encode_item(tokenizer, item), watched=target_spans(item)) for item in batch]
            limits = [item.max_new_tokens for item in batch]  # each its own: a batch's mix changes no answer
            check_request(model, prompts, limits, specs[0].mode, len(batch))
            outputs = generation.generate_each(model, tokenizer, prompts, [stacks[i] for i in needed], max_new_tokens=limits,
                                    seed=[item.random_seed(seed) for item in batch], **specs[0].generation_kwargs())
            for i, (_, results) in zip(needed, outputs):  # written as each policy finishes
                for item, result in zip(batch, results):
                    writers[i].write(_record(item, result, score_answer(item, result.text)))
                    if progress is not None:
                        progress.update(1)
    finally:
        for writer in writers:
            writer.close()
    if fidelity:
        record_run_fidelity(model, tokenizer, items, specs, dirs, batch_size, seed)
    for run_dir in dirs:
        finalize_run(run_dir)
    return dirs


def record_run_fidelity(model, tokenizer, items: list, specs: "list[RunSpec]", dirs: list[Path], batch_size: int,
                        seed: int) -> None:
    """The fidelity hook of :func:`evaluate_policies`: every compressed run against the baseline run among ``specs``."""
    baselines = [s for s in specs if s.policy.spec == "none"]
    if not baselines:
        raise UsageError("fidelity needs the baseline: add policy none (--baseline) to the same call")
    candidates = [(s, d) for s, d in zip(specs, dirs) if s.policy.spec != "none"]
    record_fidelity(model, tokenizer, items, baselines[0], candidates, batch_size=batch_size, seed=seed)


def _pending_batches(items: list, done: list[set], batch_size: int):
    """Yield ``(policy indices, items)``: batches of items that still need exactly those policies.

    Items are grouped by the set of policies not yet written for them (in
    order of first appearance), so a resumed run computes nothing already
    written; in a fresh run there is one group and the batches are ``items``'
    own consecutive slices.
    """
    groups: dict[tuple[int, ...], list] = {}
    for item in items:
        needed = tuple(i for i, finished in enumerate(done) if item.id not in finished)
        if needed:
            groups.setdefault(needed, []).append(item)
    for needed, group in groups.items():
        for first in range(0, len(group), batch_size):
            yield needed, group[first:first + batch_size]


def _open_run(run_dir: Path, spec: RunSpec, model, model_name: str, identity: dict, items: list, extra: dict | None) -> Path:
    """Create ``run_dir``'s ``run.json``, or check that the run there is this one before it is resumed."""
    if (run_dir / "run.json").is_file():
        info = read_run_info(run_dir)
        recorded = info.model_identity or {}
        if (recorded.get("hash") or identity["hash"]) != identity["hash"] or (not recorded and info.model != model_name):
            raise RunFolderError(f"{run_dir} holds runs of model {recorded.get('source') or info.model}, not {identity['source']}; "
                                 f"pass --out to a new folder, or delete {run_dir}")
        done, probes = set(), set()
        if (run_dir / "items.jsonl").is_file():
            cut_partial_item(run_dir)  # a killed run's half-written line: it is rerun
            wanted = {item.id: item.hash for item in items}
            for record in iter_items(run_dir):
                if record.id in wanted and wanted[record.id] != record.hash:
                    raise RunFolderError(f"{run_dir}: item {record.id} was run on another prompt (hash {record.hash[:12]}, "
                                         f"now {wanted[record.id][:12]}); pass --out to a new folder, or delete {run_dir}")
                done.add(record.id)
                if is_probe_record(record):
                    probes.add(record.id)
        expected = len(probes | {item.id for item in items})
        if info.extra.get("expected_items") != expected:  # more items asked of the run: it is unfinished until they are in
            info.extra["expected_items"] = expected
            write_run_info(run_dir, info)
        hardware, recorded_hardware = hardware_of(model), info.extra.get("hardware")
        if (recorded_hardware and recorded_hardware != hardware and not recorded_hardware.startswith("mixed")
                and any(item.id not in done for item in items)):
            # Items to compute elsewhere (a lost node's cell retried on another machine): the run now mixes two
            # kinds of rounding, which no comparison may take for one run's (kveval.runs.results.pair_runs).
            info.extra["hardware"] = f"mixed: {recorded_hardware} + {hardware}"
            write_run_info(run_dir, info)
        sets = info.extra.get("probe_sets") or []
        added = [s for s in (extra or {}).get("probe_sets", []) if s not in sets]
        if added:  # items of another set join the run: it records every set its items came from
            info.extra["probe_sets"] = sets + added
            write_run_info(run_dir, info)
        return run_dir
    stack = spec.policy
    info = RunInfo(name=f"{model_folder(identity)}/{spec.key}", model=model_name, policy=stack.spec, mode=spec.mode,
                   family=stack.label, ratio=stack.ratio, kv_dtype=spec.kv_dtype_name or deployment_dtype_name(model),
                   model_identity=identity,
                   extra={**(extra or {}), **representation_info(stack, model), "hardware": hardware_of(model),
                          "expected_items": len({item.id for item in items})})
    write_run_info(run_dir, info)
    return run_dir


def hardware_of(model) -> str:
    """What computed ``model``'s runs, as far as it decides the bits: the device kind and model, on a CPU the
    instruction set torch's kernels use, and torch's version, e.g. ``"cpu AVX512 (AMD EPYC), torch 2.13.0+cpu"``.

    Float kernels differ between them: on a CPU with AVX512-BF16 the quickstart sweep gave other text for 12 of
    480 items than on an AVX2 one, its baseline included. A comparison of runs made on two of them would count
    the hardware's rounding as the policy's effect (:func:`kveval.runs.results.pair_runs` refuses it)."""
    import torch

    device = next(model.parameters()).device
    if device.type == "cuda":
        name = f"cuda {torch.cuda.get_device_name(device)}"
    elif device.type == "cpu":
        name = f"cpu {torch.backends.cpu.get_cpu_capability()} ({_cpu_model()})"
    else:
        name = device.type
    return f"{name}, torch {torch.__version__}"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or "unknown"


def representation_info(stack, model) -> dict:
    """Prepare the stack's representation policies on ``model`` and return what they need recorded (e.g. calibration)."""
    info = {}
    for policy in (stack.structure, stack.quantization):
        if policy is not None:
            policy.prepare(model)
            info.update(policy.run_info(model))
    return info


