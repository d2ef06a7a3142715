"""Operations per forward: kveval against plain transformers (DynamicCache), counted, not timed.

    python3 benchmarks/op_counts.py [--model smollm2-135m] [--length 256] [--new-tokens 4]
                                    [--batch 1 --batch 8 --batch 32] [--policy SPEC ...] [--mixed-lengths]

What a GPU pays for beyond the arithmetic is a launch per operation and a
stall each time the host waits for the device. Both are counted here on any
machine, by :class:`kveval.runner.device_waits.OpCounter`: aten operations (kernels;
views, which only describe a tensor, apart), host waits (``item``/``int``/``bool``
of a tensor, ``nonzero``, boolean indexing, ``tolist``) and ``torch.tensor``
uploads from the host (on a GPU each also waits, from pageable memory).

For each batch size the script runs the same left-padded passkey prompts
through transformers' ``generate`` and through :func:`kveval.runner.generation.generate`
(``context`` mode: the context's prefill, the question's forward, then the decode
steps) and prints, per phase, the operations and waits counted between one
forward's start and the next one's: the model's own operations, the cache's
and the generation loop's. The last phase runs from the last step's forward to
the end of the generation, where kveval's rows catch up with the steps done on
the batch buffer and every row's bytes are read. A cost that grows with the batch (per row) is
what makes a GPU run of 32 rows slow; a cost per layer is paid once per layer
at any batch. The numbers are exact and the same on every machine with the same
package versions; the script takes about a minute on a CPU.
"""

from __future__ import annotations

import argparse
import collections

from kveval.policies.spec import parse_policy


def _row(label: str, counts: list[collections.Counter], batch: int) -> str:
    mean = {key: sum(c[key] for c in counts) / max(1, len(counts)) for key in ("ops", "views", "waits", "uploads")}
    waits = collections.Counter()
    for c in counts:
        waits.update({k.split(":", 1)[1]: v for k, v in c.items() if k.startswith("wait:")})
    detail = ", ".join(f"{k} {v / max(1, len(counts)):.0f}" for k, v in waits.most_common())
    return (f"  {label:<26} ops {mean['ops']:>6.0f} ({mean['ops'] / batch:>5.0f}/row) views {mean['views']:>6.0f}"
            f"  waits {mean['waits']:>5.0f}"
            f"  uploads {mean['uploads']:>5.0f}  [{detail}]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--length", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--batch", action="append", type=int, default=None, help="repeat; default 1, 8, 32")
    parser.add_argument("--policy", action="append", default=None,
                        help="kveval policies (default: none); a spec ending in ' [codes]' holds quantized layers as "
                             "codes, the default on CUDA")
    parser.add_argument("--mixed-lengths", action="store_true", help="prompts of 4 lengths (left-padded batches)")
    args = parser.parse_args()

    import torch
    from throughput import _decode_mode, _hf_generate

    from kveval.probes import encode_item, generate_items
    from kveval.runner.device_waits import OpCounter
    from kveval.runner.generation import Prompt, generate
    from kveval.runner.models import load_model

    torch.manual_seed(0)
    model, tokenizer = load_model(args.model)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    batches = args.batch or [1, 8, 32]
    lengths = [args.length, args.length * 7 // 8, args.length * 3 // 4, args.length * 5 // 8] if args.mixed_lengths else [args.length]
    items = [it for n, length in enumerate(lengths)
             for it in generate_items("passkey", tokenizer, length, -(-max(batches) // len(lengths)), seed=n)]
    items = [items[i // len(lengths) + (i % len(lengths)) * (len(items) // len(lengths))] for i in range(len(items))]
    prompts = [Prompt(*encode_item(tokenizer, it)) for it in items]
    layers = model.config.get_text_config().num_hidden_layers
    print(f"{args.model}: {layers} layers, {args.length}-token prompts{' of 4 lengths' if args.mixed_lengths else ''}, "
          f"{args.new_tokens} new tokens; per forward: aten ops, host waits (a CUDA stall each), host->device uploads")
    for batch in batches:
        chosen = prompts[:batch]
        print(f"batch {batch}")
        with OpCounter(model) as hf:
            _hf_generate(model, chosen, args.new_tokens, pad_id)
        phases = hf.phases()
        print(_row("transformers prefill", phases[:1], batch))
        print(_row("transformers decode step", phases[1:-1], batch))
        print(_row("transformers last step+end", phases[-1:], batch))
        for policy in args.policy or ["none"]:
            spec, decode_mode = _decode_mode(policy)
            with OpCounter(model) as ours:
                generate(model, tokenizer, chosen, parse_policy(spec), max_new_tokens=args.new_tokens, batch_size=batch,
                         quantized_decode=decode_mode)
            phases = ours.phases()
            print(_row(f"{policy} prefill", phases[:1], batch))
            print(_row(f"{policy} question", phases[1:2], batch))
            print(_row(f"{policy} decode step", phases[2:-1], batch))
            print(_row(f"{policy} last step+end", phases[-1:], batch))


if __name__ == "__main__":
    main()
