"""Batched greedy generation against plain transformers, token for token, with left padding and EOS.

The throughput benchmark once showed kveval ``none`` at batch 32 giving other
tokens than transformers ``generate`` at batch 32. Neither side depends on the
batch: the difference was the cache dtype. kveval stores full-precision tokens
in the deployment's ``kv_dtype`` (bfloat16 for SmolLM2) while transformers keeps
the float32 it computes in, and one of the 32 prompts (none of the first 8)
flips a token at step 12 under that rounding, at batch 1 as at batch 32. With
``kv_dtype`` equal to the compute dtype every row agrees. These tests pin that
down on tiny models: prompts of mixed lengths (so batches are left-padded) and
an EOS id that ends rows at different steps.
"""

import pytest
import torch
from tiny_models import Tok, tiny_gemma3, tiny_llama

from kveval.generation import Prompt, generate

STEPS = 12


def _prompts(n=12, seed=3):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(6, 80, (n,), generator=g).tolist()
    return [Prompt(torch.randint(3, 128, (k,), generator=g).tolist(), torch.randint(3, 128, (3,), generator=g).tolist())
            for k in lengths]


def _hf_generate(model, prompts, eos):
    """transformers ``generate`` (DynamicCache) on left-padded ``prompts``; each row's ids before its first EOS."""
    rows = [p.context + p.question for p in prompts]
    width = max(map(len, rows))
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, row in enumerate(rows):
        ids[b, width - len(row):] = torch.tensor(row)
        mask[b, width - len(row):] = 1
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=STEPS, do_sample=False,
                             pad_token_id=0, eos_token_id=eos)
    new = [row.tolist() for row in out[:, width:]]
    return [row[:row.index(eos)] if eos in row else row for row in new]


def _kveval(model, prompts, batch_size, kv_dtype):
    return [r.token_ids for r in generate(model, Tok(), prompts, "none", max_new_tokens=STEPS, batch_size=batch_size,
                                          kv_dtype=kv_dtype)]


@pytest.mark.parametrize("make", [tiny_llama, tiny_gemma3])
def test_batch_n_equals_batch_1_equals_transformers_batch_1(make):
    model = make()
    prompts = _prompts()
    assert len({p.length for p in prompts}) > 6  # mixed lengths: every batch is left-padded
    free = _kveval(model, prompts, 1, model.dtype)
    # An EOS id that ends at least two rows early, at different steps, and leaves others running to STEPS.
    eos = next(t for t in sorted({t for row in free for t in row[1:]})
               if len({row.index(t) for row in free if t in row}) >= 2 and sum(t in row for row in free) < len(free))
    model.generation_config.eos_token_id = eos

    hf_one = [_hf_generate(model, [p], eos)[0] for p in prompts]
    assert len({len(row) for row in hf_one}) >= 3  # rows stop at different steps, some run to the end
    assert max(map(len, hf_one)) == STEPS
    for size in (1, 5, len(prompts)):
        # kv_dtype equal to the compute dtype: the cache holds what transformers' DynamicCache holds.
        assert _kveval(model, prompts, size, model.dtype) == hf_one, size
    # Plain transformers does not depend on the batch here either.
    assert _hf_generate(model, prompts, eos) == hf_one
    # The deployment dtype (bfloat16 storage) changes the arithmetic, never the batch independence.
    rounded = _kveval(model, prompts, 1, None)
    assert _kveval(model, prompts, len(prompts), None) == rounded
