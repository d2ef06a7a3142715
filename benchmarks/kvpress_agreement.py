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
"""

from __future__ import annotations

import argparse
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


# ----------------------------------------------------------------------------- the kvpress worker (its own venv)

def _worker(job_path: str, out_path: str) -> None:
    """Runs inside the kvpress environment: no kveval import (it needs transformers 5)."""
    import kvpress
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, DynamicCache

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
    for method, expression in job["presses"].items():
        press = eval(expression, vars(kvpress))  # the table above, this script's own text
        kept: dict[int, list] = {}
        _record_kept(press, kept)
        observed = isinstance(press, kvpress.ObservedAttentionPress)
        model = load("eager" if observed else "sdpa")
        rows = []
        for item in job["items"]:
            torch.manual_seed(0)
            kept.clear()
            context = torch.tensor([item["context"]])
            question = torch.tensor([item["question"]])
            cache = DynamicCache()
            with torch.no_grad(), press(model):
                model(input_ids=context, past_key_values=cache, output_attentions=observed)
            if isinstance(press, (kvpress.DMSPress, kvpress.KVzipPress)):  # mask evicted keys, not drop them
                _record_masked(model, context.shape[1], kept)
            answer = _decode(model, cache, question, context.shape[1], item["max_new_tokens"], eos)
            rows.append({"id": item["id"], "answer": answer, "kept": [kept[i] for i in sorted(kept)]})
        out[method] = rows
        print(f"kvpress {method}: {len(rows)} items", file=sys.stderr, flush=True)
    Path(out_path).write_text(json.dumps(out))


def _record_kept(press, kept: dict) -> None:
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


def _decode(model, cache, question, context_length: int, max_new_tokens: int, eos: set) -> list[int]:
    """kvpress's pipeline's greedy answer: the question at the uncompressed positions, then one token at a time."""
    import torch

    with torch.no_grad():
        positions = torch.arange(context_length, context_length + question.shape[1])[None]
        logits = model(input_ids=question, past_key_values=cache, position_ids=positions).logits
        answer = []
        for _ in range(max_new_tokens):
            token = int(logits[0, -1].argmax())
            if token in eos:
                break
            answer.append(token)
            positions = positions[:, -1:] + 1
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


def kept_share(kept: list[list[list[int]]], n: int) -> float:
    """Mean fraction of the ``n`` context tokens kept, over layers and heads."""
    return statistics.fmean(len(head) / n for layer in kept for head in layer)


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
    parser.add_argument("--method", action="append", default=None, help=f"repeat; default all: {', '.join(METHODS)}")
    parser.add_argument("--venv", default=os.path.expanduser("~/.venvs/kvpress"))
    parser.add_argument("--json", default=None, help="write the per-item results here")
    args = parser.parse_args(argv)
    python = Path(args.venv) / "bin" / "python"
    if not python.is_file():
        print(f"kvpress_agreement.py: no kvpress environment at {args.venv}; create it as this script's docstring says "
              f"(python3 -m venv ~/.venvs/kvpress; ~/.venvs/kvpress/bin/pip install "
              f"kvpress-0.5.5-py3-none-any.whl 'transformers<5' torch==2.13.0)", file=sys.stderr)
        raise SystemExit(2)  # bad set-up, not a verdict: exit 1 means a gate's FAIL in this project

    import torch

    from kveval.probes import encode_item, generate_items, score_answer
    from kveval.runner.models import load_model

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    model, tokenizer = load_model(args.model, device="cpu", dtype="float32")
    items = [it for f in (args.family or ["passkey", "niah_single"]) for it in generate_items(f, tokenizer, args.length, args.n)]
    encoded = [encode_item(tokenizer, it) for it in items]
    methods = args.method or list(METHODS)
    job = {"model": model_folder(args.model),
           "presses": {m: METHODS[m][1].format(r=args.ratio) for m in methods},
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
          f"ratio {args.ratio}; baseline accuracy {statistics.fmean(r['correct'] for r in baseline):.2f}")
    print(f"{'method':<12} {'kveval spec':<52} {'acc kveval':>10} {'acc kvpress':>11} {'same R/W':>9} {'same text':>9} {'kept Jaccard':>12} {'kept share kveval / kvpress':>27}")
    for m in methods:
        ours = _kveval_side(model, tokenizer, items, encoded, METHODS[m][0].format(r=args.ratio))
        other = theirs[m]
        their_text = [tokenizer.decode(r["answer"], skip_special_tokens=True) for r in other]
        their_correct = [score_answer(it, t).correct for it, t in zip(items, their_text)]
        same = statistics.fmean(a["correct"] == b for a, b in zip(ours, their_correct))
        same_text = statistics.fmean(a["text"].strip() == t.strip() for a, t in zip(ours, their_text))
        overlap = statistics.fmean(jaccard(a["kept"], b["kept"]) for a, b in zip(ours, other))
        share_ours = statistics.fmean(kept_share(a["kept"], len(c)) for a, (c, _) in zip(ours, encoded))
        share_theirs = statistics.fmean(kept_share(b["kept"], len(c)) for b, (c, _) in zip(other, encoded))
        results[m] = {"spec": METHODS[m][0].format(r=args.ratio), "press": job["presses"][m],
                      "accuracy_kveval": statistics.fmean(r["correct"] for r in ours),
                      "accuracy_kvpress": statistics.fmean(their_correct), "same_right_wrong": same,
                      "same_answer": same_text, "kept_jaccard": overlap, "kept_share_kveval": share_ours,
                      "kept_share_kvpress": share_theirs,
                      "items": [{"id": a["id"], "kveval": a["text"], "kvpress": t, "kept_kveval": a["kept"][0],
                                 "kept_kvpress": b["kept"][0]} for a, b, t in zip(ours, other, their_text)]}
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
