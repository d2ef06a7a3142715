"""Tiny random-config models built in the tests (seconds on a CPU, no downloads)."""

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

from kveval.attention import register_attention


def tiny_llama(attn: str = "kveval", seed: int = 0):
    register_attention()
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                         attn_implementation=attn, tie_word_embeddings=False)
    return _without_eos(LlamaForCausalLM(config))


def tiny_gemma3(attn: str = "kveval", seed: int = 0, sliding_window: int = 16):
    register_attention()
    torch.manual_seed(seed)
    config = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=1024,
                              sliding_window=sliding_window, layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
                              attn_implementation=attn, query_pre_attn_scalar=32)
    return _without_eos(Gemma3ForCausalLM(config))


def _without_eos(model):
    """Random weights hit any EOS id by chance; tests want generations of a fixed length."""
    model.generation_config.eos_token_id = None
    return model.eval()
