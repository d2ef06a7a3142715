"""Throughput: kveval ``none`` against plain transformers ``generate`` (DynamicCache), and each policy family against ``none``.

    python3 benchmarks/throughput.py [--model smollm2-135m] [--length 256] [--new-tokens 16]
                                     [--batch 1 --batch 8 --batch 32] [--policy-batch 8] [--policy SPEC ...]
                                     [--repeats 1] [--mixed-lengths]

Same model object, same prompts (passkey probe items of ``--length`` tokens,
left-padded per batch), greedy, ``--new-tokens`` tokens per item:

1. *kveval none vs transformers*: at each ``--batch`` size, one batch of that
   many items through :func:`kveval.runner.generation.generate` (policy ``none``,
   ``context`` mode: the context is prefilled, then the question) and through
   ``model.generate`` with its default ``DynamicCache``; ``paired, one forward``
   times kveval in ``query`` mode too (context and question in one forward, as
   transformers runs the prompt), which leaves out the cost of the question's
   own forward pass (at batch 1 a forward reads every weight once more). Per path: seconds per
   item (whole generation / items), decode tokens/s (``items x (new - 1)``
   over the decode loop's own time, read inside the same run: from the first
   new token to the last, the ``new - 1`` forwards between them; for
   transformers, by a logits processor that notes the time of each step), and
   kveval/transformers ratios (time: <1 is faster; tokens/s: >1 is faster),
   the decode ratio also paired within each repeat. Then token agreement, in
   rows identical to transformers at *batch 1* (each prompt alone: no padding):
   kveval at this batch, transformers at this batch, and kveval with its cache
   in the compute dtype (``kv_dtype`` = the model's dtype, untimed). A row that
   differs in the first column but not the third differs because kveval stores
   full-precision tokens in the deployment's ``kv_dtype`` (bfloat16 for
   SmolLM2) while transformers keeps float32, not because of the batch; a
   difference in the second column is transformers' own batched numerics.
   ``--mixed-lengths`` draws prompts of 4 lengths (``--length`` down to 5/8 of
   it), so batches are left-padded.
2. *policy families vs kveval none* at ``--policy-batch``: the same two figures
   for each ``--policy`` (default one per family, H2O and TOVA selecting at the
   prefill, and H2O, TOVA, AdaKV and the random control under a decode budget,
   evicting at every step), as ratios to
   ``none``, the ratio of their fastest repeats (best-run ratio: the least
   disturbed by a busy machine) and the paired time ratios, of the whole
   generation and of the decode loop: the median over repeats of the policy's
   time over ``none``'s in the same repeat, with its range. Each policy takes turns with ``none`` runs of its own, back to back:
   this machine's speed drifts by 10-20% over the minutes that a round of every
   policy takes, so a ``none`` timed that long before is no reference (section 1
   pairs kveval with transformers the same way). A spec ending in
   `` [codes]`` runs a quantized policy with its layers held as codes and
   dequantized at every step (``quantized_decode="codes"``, the default on CUDA);
   the others run as the device's ``auto`` does.
3. Memory against the cache bytes kveval measured (all rows of the batch):
   on CUDA, peak allocated memory above the weights during the prefill and during
   the decode (from the prefill's end), and the decode's activations: its peak less
   the measured cache and what the cache holds beside it; on any
   device, what the cache holds beside its measured bytes once generation
   ends (a count of tensors, not an allocator figure): the layers' batch
   buffers (dequantized K/V in the compute dtype, positions, scores), the codes
   batched for decoding, and the scratch shared by the layers.
4. Only with ``--ray-sweep CONFIG`` (instead of 1-3): the sweep run serially in
   process, then on a local Ray cluster of ``--workers`` CPUs, one policy per
   cell: wall times and whether every item is identical.

Speed targets live here, not in timed tests. Run alone on the machine
(``flock /tmp/kveval-heavy.lock``): it is a timing.
"""

from __future__ import annotations

import argparse
import statistics
import time

from kveval.policies.spec import parse_policy

DEFAULT_POLICIES = ["snapkv(ratio=0.5)", "streaming(ratio=0.5)", "h2o(ratio=0.5)", "tova(ratio=0.5)",
                    "h2o(ratio=0.5,decode_budget=128)",
                    "tova(ratio=0.5,decode_budget=128)", "h2o(ratio=0.5,adaptive=true,decode_budget=128)",
                    "random(ratio=0.5,decode_budget=128)", "kivi(bits=4)", "kivi(bits=4) [codes]", "quant(bits=8)",
                    "quant(bits=8) [codes]", "fp8", "kvquant(bits=4)", "lowrank(rank=32)", "latent(rank=96)",
                    "lowrank(rank=32)+quant(bits=8)", "snapkv(ratio=0.5,adaptive=true)+kivi(bits=4)"]
CODES = " [codes]"


def _decode_mode(spec: str) -> tuple[str, str]:
    """``"kivi(bits=4) [codes]"`` -> ``("kivi(bits=4)", "codes")``; a plain spec runs as ``auto``."""
    return (spec.removesuffix(CODES), "codes") if spec.endswith(CODES) else (spec, "auto")


def _held_bytes(cache) -> dict[str, int]:
    """What ``cache`` holds beside the rows' measured stores (bytes): the batch buffers' K/V (less the rows' tokens
    that are views of them), their positions and scores, the batched codes (less the rows' codes and residual
    tails, views of them: what remains is room to grow) and the scratch the layers share."""
    def size(t) -> int:
        return 0 if t is None else t.numel() * t.element_size()

    held = {"buffers K/V": 0, "buffers positions+scores": 0, "batched codes": 0, "scratch": cache.scratch.nbytes}
    for layer in cache.attention_layers:
        buffer, decode = layer._buffer, layer._decode
        if buffer is not None:
            held["buffers K/V"] += size(buffer.keys) + size(buffer.values)
            held["buffers positions+scores"] += size(buffer.positions) + size(buffer.attention)
            if buffer.keys is not None:  # dense rows whose stores are views of the buffer (kv_dtype = compute dtype)
                shared = buffer.keys.untyped_storage().data_ptr()
                held["buffers K/V"] -= sum(row.store.nbytes for row in layer.rows if getattr(row.store, "keys", None) is not None
                                           and row.store.keys.untyped_storage().data_ptr() == shared)
        if decode is not None and decode.coded is not None:
            held["batched codes"] += sum(side.held_bytes - side.nbytes for side in decode.coded)  # its room
    return held


def _hf_generate(model, prompts, new_tokens: int, pad_id: int) -> tuple[list[list[int]], float]:
    """Plain transformers greedy generation of left-padded ``prompts`` (DynamicCache, the default): the new ids per
    row, and the seconds from the first new token's step to the last one's (the ``new_tokens - 1`` decode forwards)."""
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList

    class StepClock(LogitsProcessor):
        """Notes when each step's logits arrive (the first: right after the prompt's forward)."""

        def __init__(self):
            self.times = []

        def __call__(self, input_ids, scores):
            self.times.append(time.perf_counter())
            return scores

    rows = [p.context + p.question for p in prompts]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long, device=model.device)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        ids[b, width - len(row):] = torch.tensor(row, device=model.device)
        mask[b, width - len(row):] = 1
    clock = StepClock()
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, do_sample=False,
                             pad_token_id=pad_id, logits_processor=LogitsProcessorList([clock]))
    return [row.tolist() for row in out[:, width:]], clock.times[-1] - clock.times[0]


def _paths(runs: dict, prompts, new_tokens: int, repeats: int) -> dict:
    """Per path of ``runs`` (name -> ``run(prompts, n_new)`` giving the new ids and the decode loop's seconds):
    seconds per item, decode tokens/s, tokens at ``new_tokens``.

    The paths take turns within each repeat, each repeat starting one path later
    (a, b; b, a; ...: no path always runs first), and each
    figure is the median over repeats, so a slow spell of a shared machine falls
    on every path alike instead of on whichever ran during it; ``best_item`` is the fastest
    repeat's seconds per item (what the code costs when nothing else slowed it);
    ``whole`` and ``decode`` keep every repeat's seconds, for ratios paired within a repeat (:func:`_paired`).
    """
    import torch

    # One-off costs (a low-rank policy's calibration, first kernels) stay out of the timings. On CUDA the warm-up
    # runs the whole batch: kernels, library heuristics and the allocator's pools are per shape, and a first run
    # at a new batch shape took 2-30x a warm one on an H200.
    warm = prompts if torch.cuda.is_available() else prompts[:1]
    for run in runs.values():
        run(warm, 2)
    whole = {name: [] for name in runs}
    decode = {name: [] for name in runs}
    tokens = {}
    names = list(runs)
    for repeat in range(repeats):
        for name in names[repeat % len(names):] + names[:repeat % len(names)]:
            run = runs[name]
            start = time.perf_counter()
            tokens[name], seconds = run(prompts, new_tokens)
            whole[name].append(time.perf_counter() - start)
            decode[name].append(seconds)
    decoded = len(prompts) * (new_tokens - 1)
    out = {}
    for name in runs:
        out[name] = {"per_item": statistics.median(whole[name]) / len(prompts),
                     "decode_tps": decoded / max(statistics.median(decode[name]), 1e-9),
                     "best_item": min(whole[name]) / len(prompts), "tokens": tokens[name], "whole": whole[name],
                     "decode": decode[name]}
    return out


def _paired(path: dict, reference: dict, key: str = "whole") -> str:
    """The median over repeats of ``path``'s time (``key``: ``"whole"`` generation or ``"decode"`` loop) over
    ``reference``'s in the same repeat (adjacent runs: a slow spell of the machine falls on both), with the lowest
    and highest such ratio: ``"1.12x (1.05-1.30)"``."""
    ratios = sorted(a / b for a, b in zip(path[key], reference[key]))
    return f"{statistics.median(ratios):.2f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})"


def ray_sweep(config: str, workers: int) -> None:
    """Section 4: the same sweep serially and on Ray; wall times and item-by-item identity."""
    import tempfile
    from pathlib import Path

    from kveval.commands.main import main as kveval
    from kveval.runs.records import read_items

    def items(out: Path) -> dict:
        return {(p.parent.name, r.id): (r.answer, r.score, r.metrics["kv_bytes"])
                for p in sorted(out.glob("runs/*/*/items.jsonl")) for r in read_items(p.parent)}

    with tempfile.TemporaryDirectory() as tmp:
        walls = {}
        for name, extra in (("serial", []), ("ray", ["--executor", "ray", "--workers", str(workers)])):
            start = time.perf_counter()
            code = kveval(["sweep", config, "--out", str(Path(tmp) / name), "--quiet", *extra])
            walls[name] = time.perf_counter() - start
            if code != 0:
                raise SystemExit(f"kveval sweep ({name}) exited {code}")
        serial, on_ray = items(Path(tmp) / "serial"), items(Path(tmp) / "ray")
        cells = len({run for run, _ in serial})
    print(f"4. sweep {config}: {cells} cells, {len(serial)} items")
    print(f"serial in process {walls['serial']:.1f} s | Ray, {workers} workers {walls['ray']:.1f} s | "
          f"ratio {walls['ray'] / walls['serial']:.2f}x | identical items: {'yes' if serial == on_ray else 'NO'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=256, help="prompt tokens (default 256)")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--batch", action="append", type=int, default=None, help="repeat; default 1, 8, 32")
    parser.add_argument("--policy-batch", type=int, default=8)
    parser.add_argument("--policy", action="append", default=None, help="repeat; default one per family")
    parser.add_argument("--repeats", type=int, default=3, help="timings per figure (median; paths take turns)")
    parser.add_argument("--mixed-lengths", action="store_true",
                        help="prompts of --length, 7/8, 3/4 and 5/8 of it in turn (left-padded batches)")
    parser.add_argument("--ray-sweep", metavar="CONFIG", help="run only section 4 on this sweep config")
    parser.add_argument("--workers", type=int, default=2, help="CPUs of the local Ray cluster for --ray-sweep")
    parser.add_argument("--skip-self-check", action="store_true",
                        help="load a model that kveval's exactness check refuses (speed only: a random-weight model "
                             "from benchmarks/random_model.py, whose small bf16 logits can fall outside its tolerance)")
    args = parser.parse_args()
    if args.ray_sweep:
        ray_sweep(args.ray_sweep, args.workers)
        return

    import torch

    import kveval.runner.generation
    from kveval.cache.compressed import CompressedCache
    from kveval.probes import encode_item, generate_items
    from kveval.runner.generation import Prompt, _continue, generate, prefill_prompts
    from kveval.runner.models import load_model
    from kveval.runner.runspec import RunSpec

    model, tokenizer = load_model(args.model, self_check=not args.skip_self_check)
    # Every path generates exactly --new-tokens tokens per row: EOS is ignored by both (the decode loop is timed).
    model.generation_config.eos_token_id = None
    kveval.runner.generation.eos_ids = lambda model, tokenizer: set()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batches = args.batch or [1, 8, 32]
    count = max(batches + [args.policy_batch])
    if args.mixed_lengths:
        items = [generate_items("passkey", tokenizer, args.length - (i % 4) * args.length // 8, 1, seed=i)[0]
                 for i in range(count)]
    else:
        items = generate_items("passkey", tokenizer, args.length, count, seed=0)
    prompts = [Prompt(*encode_item(tokenizer, it)) for it in items]

    def kveval_run(spec: str, kv_dtype=None, mode: str = "context"):
        spec, decode_mode = _decode_mode(spec)
        policy = RunSpec.parse(spec).for_model(model).policy  # unset quantization groups fit the model's head width

        def run(batch, new_tokens):
            results = generate(model, tokenizer, batch, parse_policy(policy), max_new_tokens=new_tokens, batch_size=len(batch),
                               kv_dtype=kv_dtype, quantized_decode=decode_mode, mode=mode)
            # One batch: every row's decode_seconds is the loop's, from the first new token to the last.
            return [r.token_ids for r in results], results[0].decode_seconds
        return run

    generate(model, tokenizer, prompts[:1], parse_policy("none"), max_new_tokens=2)  # warm-up: first-call costs out of the timings
    _hf_generate(model, prompts[:1], 2, pad_id)
    mean_tokens = statistics.fmean(p.length for p in prompts)
    # The reference of token agreement: each prompt alone through transformers (no padding, untimed).
    hf_alone = [_hf_generate(model, [p], args.new_tokens, pad_id)[0][0] for p in prompts[:max(batches)]]
    device = str(model.device)
    print(f"model {args.model} on {device} ({model.dtype}), prompts ~{mean_tokens:.0f} tokens, {args.new_tokens} new tokens, "
          f"greedy, median of {args.repeats}")
    print()
    print("1. kveval none vs transformers generate (DynamicCache)")
    print(f"{'batch':>5} | {'hf s/item':>9} {'hf tok/s':>9} | {'kveval s/item':>13} {'kveval tok/s':>12} | "
          f"{'time ratio':>10} {'tok/s ratio':>11} {'paired time ratio':>19} {'paired, one forward':>19} "
          f"{'paired decode time':>19} | "
          f"rows equal to hf batch 1: {'kveval':>6} {'hf':>6} "
          f"{'kveval(kv=' + str(model.dtype).removeprefix('torch.') + ')':>18}")
    for size in batches:
        batch = prompts[:size]
        timed = _paths({"hf": lambda b, n: _hf_generate(model, b, n, pad_id), "kveval": kveval_run("none"),
                        "kveval one forward": kveval_run("none", mode="query")}, batch, args.new_tokens, args.repeats)
        hf, kv = timed["hf"], timed["kveval"]
        exact = kveval_run("none", kv_dtype=model.dtype)(batch, args.new_tokens)[0]

        def agree(tokens):
            return f"{sum(a == b for a, b in zip(tokens, hf_alone))}/{size}"
        print(f"{size:>5} | {hf['per_item']:>9.3f} {hf['decode_tps']:>9.1f} | {kv['per_item']:>13.3f} "
              f"{kv['decode_tps']:>12.1f} | {kv['per_item'] / hf['per_item']:>9.2f}x {kv['decode_tps'] / hf['decode_tps']:>10.2f}x "
              f"{_paired(kv, hf):>19} {_paired(timed['kveval one forward'], hf):>19} {_paired(kv, hf, 'decode'):>19} | "
              f"{'':>24} {agree(kv['tokens']):>7} {agree(hf['tokens']):>6} {agree(exact):>18}")

    print()
    print(f"2. policy families vs kveval none at batch {args.policy_batch}")
    batch = prompts[:args.policy_batch]
    policies = args.policy or DEFAULT_POLICIES
    print(f"{'policy':<24} | {'s/item':>7} {'tok/s':>8} | {'none s/item':>11} | {'time ratio':>10} {'tok/s ratio':>11} "
          f"{'best-run ratio':>14} {'paired time ratio':>19} {'paired decode time':>19}")
    for policy in policies:
        # Each policy takes turns with its own runs of none: this machine's speed drifts by 10-20% over minutes,
        # so a none timed one round of every policy earlier is no reference.
        timed = _paths({"none": kveval_run("none"), policy: kveval_run(policy)}, batch, args.new_tokens, args.repeats)
        base, got = timed["none"], timed[policy]
        print(f"{policy:<24} | {got['per_item']:>7.3f} {got['decode_tps']:>8.1f} | {base['per_item']:>11.3f} | "
              f"{got['per_item'] / base['per_item']:>9.2f}x {got['decode_tps'] / base['decode_tps']:>10.2f}x "
              f"{got['best_item'] / base['best_item']:>13.2f}x {_paired(got, base):>19} {_paired(got, base, 'decode'):>19}",
              flush=True)

    print()
    print(f"3. memory vs measured cache bytes at batch {args.policy_batch}")
    print("held beside the measured cache once generation ends (tensors the cache holds; bytes):")
    columns = list(_held_bytes(CompressedCache(model, parse_policy("none"))))
    print(f"{'policy':<30} | {'measured cache':>14} | " + " ".join(f"{c:>24}" for c in columns) + f" | {'held / cache':>12}")
    peaks = {}
    for spec in ["none", *policies]:
        plain, decode_mode = _decode_mode(spec)
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.synchronize()
            weights = torch.cuda.memory_allocated()  # the model alone: the last policy's cache is gone
            torch.cuda.reset_peak_memory_stats()
        cache = CompressedCache(model, parse_policy(RunSpec.parse(plain).for_model(model).policy), quantized_decode=decode_mode)
        with torch.no_grad():
            logits, seen = prefill_prompts(model, cache, batch, "context", pad_id)
            if cuda:  # the decode's own peak: from the prefill's end, its logits and cache held
                torch.cuda.synchronize()
                prefill_peak = torch.cuda.max_memory_allocated() - weights
                torch.cuda.reset_peak_memory_stats()
            _continue(model, tokenizer, cache, batch, "context", logits, seen, args.new_tokens, [], time.perf_counter())
        measured, held = cache.stats().kv_bytes, _held_bytes(cache)
        if cuda:
            torch.cuda.synchronize()
            peaks[spec] = (measured, held, prefill_peak, torch.cuda.max_memory_allocated() - weights)
        print(f"{spec:<30} | {measured:>14,} | " + " ".join(f"{held[c]:>24,}" for c in columns)
              + f" | {(measured + sum(held.values())) / measured:>11.2f}x")
        del cache, logits, seen
    if not peaks:
        print("peak allocated memory: no CUDA device, skipped (a CUDA allocator measurement)")
        return
    _print_peaks(peaks)


def _print_peaks(peaks: dict) -> None:
    """CUDA peak allocated memory above the weights against the measured cache (bytes). The decode's peak is read
    from the prefill's end; what it holds beyond the measured cache and the held tensors (buffers, codes' room,
    the scratch of one layer's dequantized K/V) is the step's activations, which no policy should raise much
    above ``none``'s: a second copy of the cache would show there as about the cache's size again."""
    print("peak allocated memory above the weights (CUDA allocator; bytes):")
    print(f"{'policy':<30} | {'measured cache':>14} {'held beside it':>14} {'prefill peak':>14} {'decode peak':>14} | "
          f"{'decode activations':>18} {'of none':>8} {'peak / (cache + held)':>22}")
    base = None
    for spec, (measured, held, prefill_peak, decode_peak) in peaks.items():
        beside = sum(held.values())
        activations = decode_peak - measured - beside
        base = activations if base is None else base
        print(f"{spec:<30} | {measured:>14,} {beside:>14,} {prefill_peak:>14,} {decode_peak:>14,} | "
              f"{activations:>18,} {activations / base if base else float('nan'):>7.2f}x "
              f"{decode_peak / (measured + beside):>21.2f}x")

if __name__ == "__main__":
    main()
