"""Tiny random-config models built in the tests (seconds on a CPU, no downloads)."""

import torch
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM

from kveval.cache.attention import register_attention


def tiny_llama(attn: str = "kveval", seed: int = 0):
    register_attention()
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                         attn_implementation=attn, tie_word_embeddings=False)
    return _without_eos(LlamaForCausalLM(config))


def tiny_gemma3(attn: str = "kveval", seed: int = 0, sliding_window: int = 16, layer_types=None):
    register_attention()
    torch.manual_seed(seed)
    config = Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                              num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=1024,
                              sliding_window=sliding_window,
                              layer_types=layer_types or ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"],
                              attn_implementation=attn, query_pre_attn_scalar=32)
    return _without_eos(Gemma3ForCausalLM(config))


def _without_eos(model):
    """Random weights hit any EOS id by chance; tests want generations of a fixed length."""
    model.generation_config.eos_token_id = None
    return model.eval()


# --- the architecture matrix (tests/test_architectures.py, scripts/architecture_table.py) -----------
#: Shared tiny sizes: hidden 64, 4 query / 2 KV heads of 32, vocabulary 128, 2-4 layers.
_BASE = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, tie_word_embeddings=False,
             pad_token_id=0, bos_token_id=1, eos_token_id=2)
_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)

#: name -> (config class, model class, config overrides). One entry per architecture of the matrix.
ARCHITECTURES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": None}),
    # Every layer slides (Mistral-7B-v0.1, Phi-3-mini-4k): selection acts in the window (tests/test_sliding_selection.py).
    "mistral_sliding": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 32}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", _MOE),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"sliding_window": 16, "query_pre_attn_scalar": 32}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"sliding_window": 16, "query_pre_attn_scalar": 32,
                                                         "layer_types": ["sliding_attention", "full_attention"]}),
    "gpt_oss": ("GptOssConfig", "GptOssForCausalLM", {"sliding_window": 16, "num_local_experts": 4,
                                                      "num_experts_per_tok": 2, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}}),
    "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM", {
        "num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 32, "qk_nope_head_dim": 16,
        "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}),
    "qwen3_next": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {
        **_MOE, "num_hidden_layers": 4, "shared_expert_intermediate_size": 32, "linear_num_key_heads": 2,
        "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16}),
    "bamba": ("BambaConfig", "BambaForCausalLM", {"num_hidden_layers": 3, "attn_layer_indices": [1], "mamba_n_heads": 4,
                                                  "mamba_d_state": 16, "mamba_chunk_size": 16}),
    "falcon_h1": ("FalconH1Config", "FalconH1ForCausalLM", {"mamba_d_ssm": 128, "mamba_n_heads": 4, "mamba_d_head": 32,
                                                           "mamba_d_state": 16, "mamba_chunk_size": 16}),
    "llama4": ("Llama4TextConfig", "Llama4ForCausalLM", {"attention_chunk_size": 16, "num_local_experts": 2,
                                                         "intermediate_size_mlp": 128, "no_rope_layers": [1, 0]}),
    "deepseek_v2": ("DeepseekV2Config", "DeepseekV2ForCausalLM", {
        "num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 32, "qk_nope_head_dim": 16,
        "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
        "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {"no_rope_layers": [1, 0]}),  # a layer without RoPE
    "cohere2": ("Cohere2Config", "Cohere2ForCausalLM", {"sliding_window": 16,
                                                        "layer_types": ["sliding_attention", "full_attention"]}),
    "ministral": ("MinistralConfig", "MinistralForCausalLM", {"sliding_window": 16,
                                                              "layer_types": ["sliding_attention", "full_attention"]}),
    "olmo3": ("Olmo3Config", "Olmo3ForCausalLM", {"sliding_window": 16,
                                                  "layer_types": ["sliding_attention", "full_attention"]}),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", {**_MOE, "shared_expert_intermediate_size": 32}),
    "exaone4": ("Exaone4Config", "Exaone4ForCausalLM", {"sliding_window": 16,
                                                        "layer_types": ["sliding_attention", "full_attention"]}),
}


#: Models whose own cache layers kveval mirrors part by part (kveval.cache.native_layers): DeepSeek V3.2 (MLA latent +
#: DSA indexer keys) and V4 (window 8, CSA every 4 tokens with an indexer, HCA every 16). Policy none only in the
#: matrix: selection is refused on them (tests/test_deepseek_cache.py covers quantization and refusals).
NATIVE_ARCHITECTURES = {
    "deepseek_v32": ("DeepseekV32Config", "DeepseekV32ForCausalLM", {
        "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": 24, "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16, "v_head_dim": 16, "index_n_heads": 2, "index_head_dim": 16, "index_topk": 8,
        "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "first_k_dense_replace": 1,
        "n_group": 1, "topk_group": 1}),
    # GLM's MoE-DSA: the same indexed layer, its second and third layers reusing the first's top-k ("shared").
    "glm_moe_dsa": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM", {
        "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "kv_lora_rank": 16,
        "q_lora_rank": 24, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "index_n_heads": 2,
        "index_head_dim": 16, "index_topk": 8, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "moe_intermediate_size": 32, "first_k_dense_replace": 1, "indexer_types": ["full", "shared", "full"]}),
    "deepseek_v4": ("DeepseekV4Config", "DeepseekV4ForCausalLM", {
        "num_hidden_layers": 3, "num_key_value_heads": 1, "head_dim": 32, "sliding_window": 8, "index_head_dim": 16,
        "index_n_heads": 2, "index_topk": 3,
        "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"],
        "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16}}),
}


def tiny_model(name: str, attn: str = "kveval", seed: int = 0, **config):
    """A tiny random model of architecture ``name`` (a key of :data:`ARCHITECTURES`); same seed, same weights.
    ``config``: overrides of its config."""
    import transformers

    register_attention()
    config_class, model_class, overrides = {**ARCHITECTURES, **NATIVE_ARCHITECTURES}[name]
    torch.manual_seed(seed)
    config = getattr(transformers, config_class)(**{**_BASE, **overrides, **config})
    config._attn_implementation = attn
    return _without_eos(getattr(transformers, model_class)(config))


class Tok:
    """A stand-in tokenizer for random models: ids are text."""

    eos_token_id = None
    pad_token_id = 0
    chat_template = None

    def __call__(self, text, add_special_tokens=True):
        """Text as ids (KVzip's reconstruction prompt): each character's code, folded into the tiny vocabulary."""
        return {"input_ids": [3 + ord(c) % 120 for c in text]}

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))
