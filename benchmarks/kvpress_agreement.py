"""Agreement with the reference: kvpress 0.5.5 and kveval on the same items, ratios and model, method by method.

kvpress pins transformers < 5.3 and kveval runs on transformers 5, so kvpress runs in a virtual environment of its
own, as a worker process this script starts. Create it once (every package from the local index, no network):

    python3 -m venv ~/.venvs/kvpress
    ~/.venvs/kvpress/bin/pip install kvpress-0.5.5-py3-none-any.whl 'transformers<5' torch==2.13.0

(the wheel from PyPI's kvpress 0.5.5; ``--venv`` names another environment). Then, from the repository root:

    python3 benchmarks/kvpress_agreement.py --n 10 --ratio 0.5

Both sides read the same token ids (kveval's ``encode_item``, made once here and handed to the worker), the same
weights (the embedded model's dequantized checkpoint folder), in float32 with eager attention on kvpress's side. The
context is compressed alone (query-agnostic: kveval's ``--mode context``, kvpress's pipeline), then the question is
fed at the positions of the uncompressed sequence and the answer decoded greedily. Per method it prints how many
items both score the same (right/right or wrong/wrong), how many answers are identical, and the mean Jaccard
overlap of the kept token positions, over layers and KV heads. Differences and their reasons:
docs/kvpress-agreement.md.

Decode-phase compression (``DECODING``, named with ``--method``) needs answers long enough to compress during
decoding, a long-output family:

    python3 benchmarks/kvpress_agreement.py --family recite_list --length 384 --n 8 --method decoding_knorm

There kvpress's ``DecodingPress`` is active over the question and the answer, not the prefill (its pipeline's
protocol); the question's forward is its first decode step, and kveval's too (a decode budget applies to it). The
kept positions are the whole row's (context, question and answer) after the last step.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

#: (kveval spec, kvpress press) per method, ``{r}`` the ratio. kveval's parameters are set to kvpress's defaults where
#: they differ (SnapKV's window 64 / kernel 5 / mean pooling, H2O without a recent window and ranking by mean attention), so the rules are compared,
#: not the defaults; the docs name every default that differs.
METHODS = {
    "knorm": ("knorm(ratio={r})", "KnormPress(compression_ratio={r})"),
    "streaming": ("streaming(ratio={r},sink=4)", "StreamingLLMPress(compression_ratio={r}, n_sink=4)"),
    "snapkv": ("snapkv(ratio={r},window=64,kernel=5,pooling=avg)", "SnapKVPress(compression_ratio={r})"),
    "pyramidkv": ("pyramidkv(ratio={r},window=64,kernel=5,pooling=avg,schedule=kvpress)",
                  "PyramidKVPress(compression_ratio={r})"),
    "tova": ("tova(ratio={r})", "TOVAPress(compression_ratio={r})"),
    "h2o": ("h2o(ratio={r},recent=0,mean=true)", "ObservedAttentionPress(compression_ratio={r})"),
    "random": ("random(ratio={r})", "RandomPress(compression_ratio={r})"),
    "keydiff": ("keydiff(ratio={r})", "KeyDiffPress(compression_ratio={r})"),
    "lagkv": ("lagkv(ratio={r})", "LagKVPress(compression_ratio={r})"),
    "cur": ("cur(ratio={r})", "CURPress(compression_ratio={r})"),
    "criticalkv": ("criticalkv(ratio={r},window=64,kernel=5,pooling=avg)",
                   "CriticalKVPress(SnapKVPress(compression_ratio={r}))"),
    "chunkkv": ("chunkkv(ratio={r},window=64,kernel=5,pooling=avg)", "ChunkKVPress(SnapKVPress(compression_ratio={r}))"),
    "expected_attention": ("expected_attention(ratio={r})", "ExpectedAttentionPress(compression_ratio={r})"),
    # A threshold reaches its own ratio (about 0.5 on SmolLM2-135M's probes at -0.8): the ratio is not used.
    "threshold": ("threshold(scorer=keydiff,threshold=-0.8,window=128)",
                  "DMSPress(KeyDiffPress(), threshold=-0.8, sliding_window_size=128)"),
    # Reconstruction forwards after the prefill, one budget over every layer (kvpress's layerwise=False default).
    "kvzip": ("kvzip(ratio={r})", "KVzipPress(compression_ratio={r})"),
}

#: Decode-phase compression, ``{t}`` the budget (kvpress's ``target_size``) and ``{n}`` the interval: nothing is
#: compressed at the prefill (kveval's ``ratio=0``), and every ``{n}`` decode steps the cache goes back to ``{t}``
#: tokens. Run only when named (``--method decoding_knorm``): on the default short-answer probes nothing would be
#: compressed. kveval's keydiff has no decode budget (its scores come from the prefill only), so knorm alone.
DECODING = {
    "decoding_knorm": ("knorm(ratio=0,decode_budget={t},decode_interval={n})",
                       "DecodingPress(KnormPress(), compression_interval={n}, target_size={t})"),
    # A diagnostic, not kvpress's rule: its KnormPress made to keep the newest token, as kveval's decode budget does.
    "decoding_knorm_newest": ("knorm(ratio=0,decode_budget={t},decode_interval={n})",
                              "DecodingPress(newest_kept(KnormPress()), compression_interval={n}, target_size={t})"),
}


# ----------------------------------------------------------------------------- the kvpress worker (its own venv)

def _worker(job_path: str, out_path: str) -> None:
    """Runs inside the kvpress environment: no kveval import (it needs transformers 5)."""
    import kvpress
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

    # The threads of kveval's side (main): on a shared CPU, more threads than cores spin and run an order slower.
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    job = json.loads(Path(job_path).read_text())
    config = AutoConfig.from_pretrained(job["model"])
    rope = getattr(config, "rope_parameters", None)  # transformers 5's key; 4.x reads rope_theta (else 10,000)
    if isinstance(rope, dict) and rope.get("rope_type", "default") == "default" and "rope_theta" in rope:
        config.rope_theta = rope["rope_theta"]
    models = {}  # SDPA as kvpress's pipeline runs; eager for ObservedAttentionPress, which reads the probabilities

    def load(attention: str):
        if attention not in models:
            models[attention] = AutoModelForCausalLM.from_pretrained(job["model"], config=config, dtype=torch.float32,
                                                                     attn_implementation=attention).eval()
        return models[attention]

    if job.get("tokenizer"):  # KVzipPress loads the tokenizer from the model's folder, which holds the weights alone
        load("sdpa").config.name_or_path = job["tokenizer"]
    eos = load("sdpa").generation_config.eos_token_id
    eos = set(eos if isinstance(eos, list) else [eos])
    out = {}
    for method, expressions in job["presses"].items():
        rows = []
        for i, item in enumerate(job["items"]):  # one press per method, or one per item (a decode budget per item)
            if i == 0 or isinstance(expressions, list):
                press = eval(expressions[i] if isinstance(expressions, list) else expressions,
                             {**vars(kvpress), "newest_kept": _newest_kept})
                kept: dict[int, list] = {}
                # Tokens fed so far, the last forward's included (a decoding press's positions); its compressions of a
                # layer's head, and how many of them dropped the newest token.
                fed = [0, 0, 0]
                decoding = isinstance(press, kvpress.DecodingPress)
                (_track_decoding if decoding else _record_kept)(press, kept, fed)
                observed = isinstance(press, kvpress.ObservedAttentionPress)
                model = load("eager" if observed else "sdpa")
            torch.manual_seed(0)
            kept.clear()
            fed[1:] = [0, 0]
            context = torch.tensor([item["context"]])
            question = torch.tensor([item["question"]])
            cache = DynamicCache()
            # As kvpress's pipeline: a DecodingPress is not active at the prefill, and is over the question and answer.
            with torch.no_grad(), (contextlib.nullcontext() if decoding else press(model)):
                model(input_ids=context, past_key_values=cache, output_attentions=observed)
            if isinstance(press, (kvpress.DMSPress, kvpress.KVzipPress)):  # mask evicted keys, not drop them
                _record_masked(model, context.shape[1], kept)
            with (press(model) if decoding else contextlib.nullcontext()):
                answer = _decode(model, cache, question, context.shape[1], item["max_new_tokens"], eos, fed)
            held = kept
            if decoding:  # every layer's positions after the last step
                shapes = [layer.keys.shape for layer in cache.layers]
                held = {i: [sorted(head) for head in _held(kept, i, shape[2], fed[0], shape[1])]
                        for i, shape in enumerate(shapes)}
            rows.append({"id": item["id"], "answer": answer, "kept": [held[i] for i in sorted(held)],
                         "compressions": fed[1], "newest_dropped": fed[2]})
        out[method] = rows
        print(f"kvpress {method}: {len(rows)} items", file=sys.stderr, flush=True)
    Path(out_path).write_text(json.dumps(out))


def _record_kept(press, kept: dict, fed: list) -> None:
    """Wrap ``press.compress`` so that each layer's kept positions (``[heads][kept]``) land in ``kept``: the returned
    keys found among the layer's keys (post-RoPE keys of distinct positions are distinct)."""
    import torch

    inner = press.compress

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        new_keys, new_values = inner(module, hidden_states, keys, values, attentions, kwargs)
        heads = []
        for h in range(keys.shape[1]):
            match = (new_keys[0, h, :, None, :] == keys[0, h, None, :, :]).all(dim=-1)  # [kept, n]
            heads.append(sorted(int(i) for i in match.float().argmax(dim=1)))
        kept[module.layer_idx] = heads
        return new_keys, new_values

    press.compress = compress
    del torch


def _newest_kept(press):
    """``press`` (a kvpress ScorerPress) ranking the newest token of the cache, its last, above every other."""
    inner = press.score

    def score(module, hidden_states, keys, values, attentions, kwargs):
        scores = inner(module, hidden_states, keys, values, attentions, kwargs)
        scores[..., -1] = float("inf")
        return scores

    press.score = score
    return press


def _held(kept: dict, layer: int, n: int, end: int, heads: int) -> list[list[int]]:
    """The positions of the ``n`` tokens a decoding press's layer holds once ``end`` tokens were fed: those
    ``kept[layer]`` held after its last compression, then the tokens fed since (every token before the first)."""
    before = kept.get(layer, [[] for _ in range(heads)])
    return [head + list(range(end - (n - len(head)), end)) for head in before]


def _track_decoding(press, kept: dict, fed: list) -> None:
    """Wrap a ``DecodingPress``'s ``compress`` so that ``kept[layer]`` is, per head, the positions its layer holds
    after each compression, in the order it holds them (kvpress's top-k order, not the positions'): the returned
    keys matched to the layer's keys, whose positions are :func:`_held`'s."""
    import torch

    inner = press.compress

    def compress(module, hidden_states, keys, values, attentions, kwargs):
        new_keys, new_values = inner(module, hidden_states, keys, values, attentions, kwargs)
        held = _held(kept, module.layer_idx, keys.shape[2], fed[0], keys.shape[1])
        heads = []
        for h in range(keys.shape[1]):
            match = (new_keys[0, h, :, None, :] == keys[0, h, None, :, :]).all(dim=-1)  # [kept, n]
            heads.append([held[h][int(i)] for i in match.float().argmax(dim=1)])  # in the cache's order (top-k's)
            if new_keys.shape[2] < keys.shape[2]:  # kveval always keeps the newest token: count where kvpress does not
                fed[1] += 1
                fed[2] += fed[0] - 1 not in heads[-1]
        kept[module.layer_idx] = heads
        return new_keys, new_values

    press.compress = compress
    del torch


def _record_masked(model, n: int, kept: dict) -> None:
    """Each layer's kept positions where the press masks keys (``module.masked_key_indices``) rather than drops them."""
    heads = model.config.num_key_value_heads
    for module in model.modules():
        if hasattr(module, "masked_key_indices") and hasattr(module, "layer_idx"):
            masked = [set() for _ in range(heads)]
            if module.masked_key_indices is not None:
                _, head, seq = module.masked_key_indices
                for h, i in zip(head.tolist(), seq.tolist()):
                    masked[h].add(i)
            kept[module.layer_idx] = [[i for i in range(n) if i not in masked[h]] for h in range(heads)]


def _decode(model, cache, question, context_length: int, max_new_tokens: int, eos: set, fed: list) -> list[int]:
    """kvpress's pipeline's greedy answer: the question at the uncompressed positions (one forward: a decode step
    to a ``DecodingPress``, whose hooks call a forward prefill only when it starts at position 0), then one token at
    a time; the last token is not fed back (as kvpress's pipeline and kveval). ``fed[0]``: tokens fed so far."""
    import torch

    with torch.no_grad():
        positions = torch.arange(context_length, context_length + question.shape[1])[None]
        fed[0] = context_length + question.shape[1]
        logits = model(input_ids=question, past_key_values=cache, position_ids=positions).logits
        answer = []
        while len(answer) < max_new_tokens:
            token = int(logits[0, -1].argmax())
            if token in eos:
                break
            answer.append(token)
            if len(answer) == max_new_tokens:
                break
            positions = positions[:, -1:] + 1
            fed[0] += 1
            logits = model(input_ids=torch.tensor([[token]]), past_key_values=cache, position_ids=positions).logits
    return answer


# ----------------------------------------------------------------------------- kveval's side and the comparison

def _kveval_side(model, tokenizer, items, encoded, spec: str) -> list[dict]:
    import torch

    from kveval.cache.compressed import CompressedCache
    from kveval.policies.spec import parse_policy
    from kveval.probes import score_answer
    from kveval.runner.generation import Prompt, generate, reconstruct_and_compress

    stack = parse_policy(spec)
    rows = []
    for item, (context, question) in zip(items, encoded):
        result = generate(model, tokenizer, [Prompt(context, question)], stack, max_new_tokens=item.max_new_tokens,
                          mode="context", seed=0, kv_dtype=torch.float32)[0]
        cache = CompressedCache(model, stack, kv_dtype=torch.float32)
        with torch.no_grad():
            model(torch.tensor([context]), cache=cache, use_cache=True,
                  position_ids=torch.arange(len(context))[None])
            if cache.awaiting_reconstruction:  # KVzip: its reconstruction forwards, then the compression
                reconstruct_and_compress(model, tokenizer, cache, [context], tokenizer.pad_token_id or 0)
        kept = [sorted_heads(layer.rows[0].positions) for layer in cache.layers if getattr(layer, "_rows", None)]
        rows.append({"id": item.id, "text": result.text, "correct": score_answer(item, result.text).correct, "kept": kept})
    return rows


def _kveval_decoding_side(model, tokenizer, items, encoded, specs: list[str]) -> list[dict]:
    """``specs[i]`` on item ``i`` through kveval's own generation (the steps of ``generate`` at batch size 1, so
    that its cache can be read afterwards): the kept positions are the whole row's after the last decode step."""
    import time

    import torch

    from kveval.cache.compressed import CompressedCache
    from kveval.policies.spec import parse_policy
    from kveval.probes import score_answer
    from kveval.runner.generation import Prompt, _continue, prefill_prompts

    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    rows = []
    for item, (context, question), spec in zip(items, encoded, specs):
        torch.manual_seed(0)
        prompt = Prompt(context, question)
        cache = CompressedCache(model, parse_policy(spec), seed=0, kv_dtype=torch.float32)
        with torch.no_grad():
            last_logits, seen = prefill_prompts(model, cache, [prompt], "context", pad_id)
            result = _continue(model, tokenizer, cache, [prompt], "context", last_logits, seen, item.max_new_tokens,
                               [], time.perf_counter())[0]
        kept = [sorted_heads(layer.rows[0].positions) for layer in cache.layers if getattr(layer, "_rows", None)]
        rows.append({"id": item.id, "text": result.text, "correct": score_answer(item, result.text).correct, "kept": kept,
                     "ids": result.token_ids})
    return rows


def sorted_heads(positions) -> list[list[int]]:
    """Each KV head's kept positions; per-head stores pad heads holding fewer at kveval's padding position."""
    from kveval.tensors.batch_buffer import PAD_POSITION

    return [sorted(int(p) for p in head if 0 <= int(p) < PAD_POSITION) for head in positions]


def jaccard(a: list[list[list[int]]], b: list[list[list[int]]]) -> float:
    """Mean Jaccard overlap of kept positions over layers and heads."""
    scores = []
    for layer_a, layer_b in zip(a, b):
        for head_a, head_b in zip(layer_a, layer_b):
            sa, sb = set(head_a), set(head_b)
            scores.append(len(sa & sb) / max(1, len(sa | sb)))
    return statistics.fmean(scores) if scores else float("nan")


def fed_tokens(context: list[int], question: list[int], answer: list[int], max_new_tokens: int) -> int:
    """Tokens a row was fed: context, question and answer, the answer's last token not when it reached the limit."""
    return len(context) + len(question) + len(answer) - (len(answer) == max_new_tokens)


def kept_share(kept: list[list[list[int]]], n: int) -> float:
    """Mean fraction of the ``n`` context tokens kept (decode-phase methods: of the tokens fed), over layers and heads."""
    return statistics.fmean(len(head) / n for layer in kept for head in layer)


def decode_budgets(encoded, budget: str, interval: int) -> list[int]:
    """Each item's decode budget T: ``budget`` tokens, or with ``"aligned"`` the prompt's length P less one.

    kvpress's DecodingPress compresses every ``interval`` steps (the question's forward the first step), kveval when
    a row holds ``T + interval`` tokens. With T = P - 1 both first compress at step ``interval``, when the row holds
    ``P + interval - 1 = T + interval`` tokens, and then every ``interval`` steps; a T below that makes kveval
    compress at the question already (the row is over ``T + interval - 1``), kvpress only ``interval`` steps later.
    """
    return [len(c) + len(q) - 1 if budget == "aligned" else int(budget) for c, q in encoded]


def model_folder(name: str) -> str:
    """The embedded model's dequantized checkpoint folder (written when kveval first loads it)."""
    from kveval.modeling.sources import EMBEDDED, _dequantized_cache

    gguf = EMBEDDED[name].gguf_path()
    return str(_dequantized_cache(gguf) / "model")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--family", action="append", default=None, help="probe family; repeat (default passkey, niah_single)")
    parser.add_argument("--length", type=int, default=512)
    parser.add_argument("--n", type=int, default=10, help="items per family")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--method", action="append", default=None,
                        help=f"repeat; default all: {', '.join(METHODS)}; also, only when named: {', '.join(DECODING)}")
    parser.add_argument("--decode-budget", default="aligned",
                        help="decode-phase methods' budget T (kvpress's target_size), tokens; 'aligned' (default): per "
                             "item, the prompt's length less one, where both compress at the same steps")
    parser.add_argument("--decode-interval", type=int, default=16,
                        help="decode-phase methods' interval N (kvpress's compression_interval), steps")
    parser.add_argument("--venv", default=os.path.expanduser("~/.venvs/kvpress"))
    parser.add_argument("--json", default=None, help="write the per-item results here")
    args = parser.parse_args(argv)
    python = Path(args.venv) / "bin" / "python"
    if not python.is_file():
        print(f"kvpress_agreement.py: no kvpress environment at {args.venv}; create it as this script's docstring says "
              f"(python3 -m venv ~/.venvs/kvpress; ~/.venvs/kvpress/bin/pip install "
              f"kvpress-0.5.5-py3-none-any.whl 'transformers<5' torch==2.13.0)", file=sys.stderr)
        raise SystemExit(2)  # bad set-up, not a verdict: exit 1 means a gate's FAIL in this project
    unknown = [m for m in args.method or [] if m not in METHODS and m not in DECODING]
    budget = args.decode_budget
    if unknown or (budget != "aligned" and not (budget.isdigit() and int(budget) > 0)) or args.decode_interval < 1:
        print("kvpress_agreement.py: " + (f"unknown method {unknown[0]!r}; known: {', '.join([*METHODS, *DECODING])}"
              if unknown else f"--decode-budget {budget!r} and --decode-interval {args.decode_interval} must be "
              f"positive numbers of tokens and steps (or --decode-budget aligned)"), file=sys.stderr)
        raise SystemExit(2)

    import torch

    from kveval.probes import encode_item, generate_items, score_answer
    from kveval.runner.models import load_model

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    model, tokenizer = load_model(args.model, device="cpu", dtype="float32")
    items = [it for f in (args.family or ["passkey", "niah_single"]) for it in generate_items(f, tokenizer, args.length, args.n)]
    encoded = [encode_item(tokenizer, it) for it in items]
    methods = args.method or list(METHODS)
    # Decode-phase methods: one budget per item when aligned (see decode_budgets), so one spec and press per item.
    budgets = decode_budgets(encoded, args.decode_budget, args.decode_interval)
    specs = {m: [DECODING[m][0].format(t=t, n=args.decode_interval) for t in budgets] if m in DECODING
             else METHODS[m][0].format(r=args.ratio) for m in methods}
    presses = {m: [DECODING[m][1].format(t=t, n=args.decode_interval) for t in budgets] if m in DECODING
               else METHODS[m][1].format(r=args.ratio) for m in methods}
    job = {"model": model_folder(args.model),
           "presses": presses,
           "items": [{"id": it.id, "context": c, "question": q, "max_new_tokens": it.max_new_tokens}
                     for it, (c, q) in zip(items, encoded)]}
    with tempfile.TemporaryDirectory() as tmp:
        job_path, out_path = Path(tmp) / "job.json", Path(tmp) / "out.json"
        if "kvzip" in methods:  # KVzipPress reads the chat template from the tokenizer's folder
            folder = Path(tmp) / "tokenizer"
            tokenizer.save_pretrained(folder)
            config = json.loads((folder / "tokenizer_config.json").read_text())
            config["tokenizer_class"] = "PreTrainedTokenizerFast"  # transformers 5's class name, unknown to 4.x
            (folder / "tokenizer_config.json").write_text(json.dumps(config))
            job["tokenizer"] = str(folder)
        job_path.write_text(json.dumps(job))
        subprocess.run([str(python), __file__, "--worker", str(job_path), str(out_path)], check=True,
                       env={**os.environ, "PYTHONPATH": ""})
        theirs = json.loads(out_path.read_text())
    baseline = _kveval_side(model, tokenizer, items, encoded, "none")
    results = {}
    print(f"{args.model}, {len(items)} items ({', '.join(sorted({it.family for it in items}))}, {args.length} tokens), "
          f"ratio {args.ratio}" + (f", decode budget {args.decode_budget}, interval {args.decode_interval}"
                                   if any(m in DECODING for m in methods) else "")
          + f"; baseline accuracy {statistics.fmean(r['correct'] for r in baseline):.2f}")
    print(f"{'method':<12} {'kveval spec':<52} {'acc kveval':>10} {'acc kvpress':>11} {'same R/W':>9} {'same text':>9} {'kept Jaccard':>12} {'kept share kveval / kvpress':>27}")
    for m in methods:
        decoding = m in DECODING
        if decoding:
            ours = _kveval_decoding_side(model, tokenizer, items, encoded, specs[m])
        else:
            ours = _kveval_side(model, tokenizer, items, encoded, specs[m])
        other = theirs[m]
        their_text = [tokenizer.decode(r["answer"], skip_special_tokens=True) for r in other]
        their_correct = [score_answer(it, t).correct for it, t in zip(items, their_text)]
        same = statistics.fmean(a["correct"] == b for a, b in zip(ours, their_correct))
        same_text = statistics.fmean(a["text"].strip() == t.strip() for a, t in zip(ours, their_text))
        overlap = statistics.fmean(jaccard(a["kept"], b["kept"]) for a, b in zip(ours, other))
        if decoding:  # shares of the tokens each side was fed (the same where the answers are)
            share_ours = statistics.fmean(kept_share(a["kept"], fed_tokens(c, q, a["ids"], it.max_new_tokens))
                                          for a, (c, q), it in zip(ours, encoded, items))
            share_theirs = statistics.fmean(kept_share(b["kept"], fed_tokens(c, q, b["answer"], it.max_new_tokens))
                                            for b, (c, q), it in zip(other, encoded, items))
        else:
            share_ours = statistics.fmean(kept_share(a["kept"], len(c)) for a, (c, _) in zip(ours, encoded))
            share_theirs = statistics.fmean(kept_share(b["kept"], len(c)) for b, (c, _) in zip(other, encoded))
        spec = specs[m] if not decoding else DECODING[m][0].format(t=args.decode_budget, n=args.decode_interval)
        results[m] = {"spec": spec, "press": job["presses"][m],
                      "accuracy_kveval": statistics.fmean(r["correct"] for r in ours),
                      "accuracy_kvpress": statistics.fmean(their_correct), "same_right_wrong": same,
                      "same_answer": same_text, "kept_jaccard": overlap, "kept_share_kveval": share_ours,
                      "kept_share_kvpress": share_theirs,
                      "items": [{"id": a["id"], "kveval": a["text"], "kvpress": t, "kept_kveval": a["kept"][0],
                                 "kept_kvpress": b["kept"][0]} for a, b, t in zip(ours, other, their_text)]}
        if decoding:
            results[m].update(decode_budgets=budgets, decode_interval=args.decode_interval,
                              prompt_lengths=[len(c) + len(q) for c, q in encoded],
                              answer_tokens_kveval=[len(a["ids"]) for a in ours],
                              answer_tokens_kvpress=[len(b["answer"]) for b in other],
                              # kvpress's compressions (per layer and KV head) and those that dropped the newest token
                              compressions_kvpress=[b["compressions"] for b in other],
                              newest_dropped_kvpress=[b["newest_dropped"] for b in other])
        r = results[m]
        print(f"{m:<12} {r['spec']:<52} {r['accuracy_kveval']:>10.2f} {r['accuracy_kvpress']:>11.2f} "
              f"{same:>9.0%} {same_text:>9.0%} {overlap:>12.3f} {share_ours:>7.3f} / {share_theirs:.3f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--worker":
        _worker(sys.argv[2], sys.argv[3])
    else:
        main()
