"""The memory planner's presets: ``config.json`` excerpts (the fields the planner reads) of well-known models, their
aliases, and the Hub ids planned with each preset's shape (:mod:`kveval.planner.model_specs` reads them)."""

from __future__ import annotations

import re
from typing import Any

# ----------------------------------------------------------------------------------------------
# presets: config.json excerpts (the fields the planner reads) of well-known models

#: DeepSeek-V4's cache as its report stores it: KV entries (window, CSA, HCA) in FP8 with BF16 RoPE values, the
#: CSA indexer's keys in FP4; the pending-window state as transformers holds it (the model dtype).
_V4_STORAGE = {"window": "fp8-mixed", "csa-entries": "fp8-mixed", "hca-entries": "fp8-mixed", "csa-indexer": "fp4-32",
               "state": "bf16"}

PRESETS: dict[str, dict[str, Any]] = {
    "llama-2-7b": {
        "_name_or_path": "meta-llama/Llama-2-7b-hf", "model_type": "llama", "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 32, "hidden_size": 4096, "intermediate_size": 11008,
        "vocab_size": 32000, "max_position_embeddings": 4096, "tie_word_embeddings": False,
        "num_parameters": 6_738_415_616,
    },
    "llama-3.1-8b": {
        "_name_or_path": "meta-llama/Llama-3.1-8B", "model_type": "llama", "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "intermediate_size": 14336,
        "vocab_size": 128256, "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "num_parameters": 8_030_261_248,
    },
    "mistral-7b": {
        "_name_or_path": "mistralai/Mistral-7B-v0.1", "model_type": "mistral", "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096, "intermediate_size": 14336,
        "vocab_size": 32000, "max_position_embeddings": 32768, "sliding_window": 4096, "tie_word_embeddings": False,
        "num_parameters": 7_241_732_096,
    },
    "qwen2.5-7b": {
        "_name_or_path": "Qwen/Qwen2.5-7B", "model_type": "qwen2", "num_hidden_layers": 28,
        "num_attention_heads": 28, "num_key_value_heads": 4, "hidden_size": 3584, "intermediate_size": 18944,
        "vocab_size": 152064, "max_position_embeddings": 131072, "sliding_window": 131072,
        "use_sliding_window": False, "max_window_layers": 28, "tie_word_embeddings": False,
        "num_parameters": 7_615_616_512,
    },
    "gemma-3-27b": {
        "_name_or_path": "google/gemma-3-27b-pt", "model_type": "gemma3_text", "num_hidden_layers": 62,
        "num_attention_heads": 32, "num_key_value_heads": 16, "head_dim": 128, "hidden_size": 5376,
        "intermediate_size": 21504, "vocab_size": 262208, "max_position_embeddings": 131072,
        "sliding_window": 1024, "sliding_window_pattern": 6, "tie_word_embeddings": True,
        "num_parameters": 27_432_406_640,  # with the vision tower, as the Hub lists it
    },
    "gemma3-270m": {
        "_name_or_path": "google/gemma-3-270m", "model_type": "gemma3_text", "num_hidden_layers": 18,
        "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "hidden_size": 640,
        "intermediate_size": 2048, "vocab_size": 262144, "max_position_embeddings": 32768,
        "sliding_window": 512, "sliding_window_pattern": 6, "tie_word_embeddings": True,
        "num_parameters": 268_098_176,
    },
    "smollm2-135m": {
        "_name_or_path": "HuggingFaceTB/SmolLM2-135M", "model_type": "llama", "num_hidden_layers": 30,
        "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576, "intermediate_size": 1536,
        "vocab_size": 49152, "max_position_embeddings": 8192, "tie_word_embeddings": True,
        "num_parameters": 134_515_008,
    },
    "deepseek-v3": {
        "_name_or_path": "deepseek-ai/DeepSeek-V3", "model_type": "deepseek_v3", "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "hidden_size": 7168, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128, "vocab_size": 129280,
        "max_position_embeddings": 163840, "n_routed_experts": 256, "moe_intermediate_size": 2048,
        "first_k_dense_replace": 3, "num_parameters": 671_026_419_200,
        # its config.json's: the checkpoint's weights are FP8 (1 byte per parameter; :func:`weights_of`)
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128]},
    },
    # --- the DeepSeek chronicle (``kveval memory --compare``); ``kv_storage`` is how each model's own serving stack
    # stores its cache's parts (kveval.planner.native.FORMATS), where that differs from the planned dtype.
    # DeepSeek LLM 67B: dense GQA, 95 layers x 8 KV heads x 128 (deepseek-ai/deepseek-llm-67b-base config.json).
    "deepseek-67b": {
        "_name_or_path": "deepseek-ai/deepseek-llm-67b-base", "model_type": "llama", "num_hidden_layers": 95,
        "num_attention_heads": 64, "num_key_value_heads": 8, "hidden_size": 8192, "intermediate_size": 22016,
        "vocab_size": 102400, "max_position_embeddings": 4096, "tie_word_embeddings": False,
    },
    # DeepSeek-V2: MLA in 60 layers. Its report deploys the cache at 6 bits per value on average (--storage all=6bit);
    # the preset plans it in the planned dtype, as V3's.
    "deepseek-v2": {
        "_name_or_path": "deepseek-ai/DeepSeek-V2", "model_type": "deepseek_v2", "num_hidden_layers": 60,
        "num_attention_heads": 128, "num_key_value_heads": 128, "hidden_size": 5120, "kv_lora_rank": 512,
        "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
        "vocab_size": 102400, "max_position_embeddings": 163840, "n_routed_experts": 160,
    },
    # DeepSeek-V3.2: V3's MLA plus DSA's lightning-indexer keys (index_head_dim 128 per token and layer). Stored as
    # DeepSeek serves it (FlashMLA's FP8 sparse decoding): the latent in FP8 with a float32 scale per 128 values,
    # the RoPE key in BF16 (656 bytes per token and layer), the indexer keys in FP8 with a float32 scale per 128.
    "deepseek-v3.2": {
        "_name_or_path": "deepseek-ai/DeepSeek-V3.2", "model_type": "deepseek_v32", "num_hidden_layers": 61,
        "num_attention_heads": 128, "num_key_value_heads": 128, "hidden_size": 7168, "kv_lora_rank": 512,
        "q_lora_rank": 1536, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
        "index_head_dim": 128, "index_n_heads": 64, "index_topk": 2048, "vocab_size": 129280,
        "max_position_embeddings": 163840, "n_routed_experts": 256, "moe_intermediate_size": 2048,
        "first_k_dense_replace": 3, "num_parameters": 671_026_419_200,
        "kv_storage": {"latent": "fp8-128", "rope": "bf16", "indexer": "fp8-128"},
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128]},
    },
    # DeepSeek-V4-Flash (deepseek-ai/DeepSeek-V4-Flash config.json): 43 layers, one KV head of 512 (64 RoPE),
    # sliding_window 128 on every layer, compress_ratios 0 = sliding only, 4 = CSA, 128 = HCA (the last entry is the
    # MTP layer's, not planned). Stored as the V4 report describes: KV entries FP8 with BF16 RoPE values, indexer
    # keys FP4 (the report quantizes the indexer's QK path to FP4; the 1-byte scale per 32 is assumed).
    "deepseek-v4-flash": {
        "_name_or_path": "deepseek-ai/DeepSeek-V4-Flash", "model_type": "deepseek_v4", "num_hidden_layers": 43,
        "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
        "hidden_size": 4096, "q_lora_rank": 1024, "index_head_dim": 128, "index_n_heads": 64, "index_topk": 512,
        "sliding_window": 128, "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0], "vocab_size": 129280,
        "max_position_embeddings": 1048576, "n_routed_experts": 256,
        "kv_storage": _V4_STORAGE,
        # Weights as the checkpoint ships them: FP8 blocks of 128 x 128, the routed experts MXFP4 (vLLM's
        # DeepseekV4FP8Config: "DeepSeek V4 checkpoints always use FP8 block quantization for linear/attention
        # layers", expert_dtype "fp4" for V4-Flash). Assumed, as its config.json was not at hand: 284e9 parameters
        # (the model card's rounded count) and moe_intermediate_size 2048 (276.97e9 routed-expert parameters).
        "moe_intermediate_size": 2048, "num_parameters": 284_000_000_000, "expert_dtype": "fp4",
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128]},
    },
    # DeepSeek-V4.1-Flash: 40 layers; compress_ratios 0 (layers 0-1: window only), 2 (2-19), 1 (20-39), plus three
    # entries for the draft model (not planned); one K=V latent of 512 (64 RoPE) and a 128-token window in every
    # layer. Cross-layer reuse: only kv_source_layer_ids store compressed KV and the indexer keys (index_k) beside it;
    # the 8 index_source_layer_ids run the indexer over the nearest source's keys, and candidate_source_layer_id 20
    # splits them into a prefix and a candidate path. The layer lists and hidden_size are as public reimplementations
    # of the checkpoint read its config.json (transformers 5.25 has none). Stored as the V4.1 report describes:
    # compressed KV in FP4 after RoPE (E2M1, an E4M3 scale per 16: 288 B an entry), the window in FP8 (UE8M0 per 32:
    # 528 B), indexer keys in FP4 (UE8M0 per 32: 68 B). Its 890 B/token: 3 sources at ratio 2 and 1 at ratio 1.
    "deepseek-v4.1-flash": {
        "_name_or_path": "deepseek-ai/DeepSeek-V4.1-Flash", "model_type": "deepseek_v41", "num_hidden_layers": 40,
        "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64,
        "hidden_size": 5120, "index_head_dim": 128, "index_topk": 512, "sliding_window": 128,
        "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
        "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
        "candidate_source_layer_id": 20, "vocab_size": 129280, "max_position_embeddings": 1048576,
        "kv_storage": {"window": "fp8-32", "csa-entries": "fp4-16", "csa-indexer": "fp4-32"},
        # weights stored as V4-Flash's (assumed: FP8 blocks, MXFP4 routed experts); its parameter count was not at
        # hand, so an engine plan needs --weights
        "expert_dtype": "fp4",
        "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                                "weight_block_size": [128, 128]},
    },
}

# DeepSeek-V4-Pro: V4-Flash's cache layout and storage in 61 layers, 2 HCA then CSA/HCA alternating from CSA (30 CSA,
# 31 HCA). Assumed, as its config.json was not at hand: the count is the one vLLM's V4 breakdown uses (9.62 GiB in
# BF16 at 1M tokens, which this layout reproduces); the pattern follows V4-Flash's. Fields the planner does not read
# and that were not found for V4-Pro (attention heads, q_lora_rank, index_topk) are left out.
PRESETS["deepseek-v4-pro"] = {k: v for k, v in PRESETS["deepseek-v4-flash"].items()
                              if k not in ("num_attention_heads", "q_lora_rank", "index_topk", "num_parameters",
                                           "moe_intermediate_size")} | {
    "_name_or_path": "deepseek-ai/DeepSeek-V4-Pro", "num_hidden_layers": 61, "hidden_size": 7168,
    "n_routed_experts": 384, "compress_ratios": [128, 128] + [4, 128] * 29 + [4, 0],
}


_ALIASES = {"gemma3-27b": "gemma-3-27b", "gemma-3-270m": "gemma3-270m", "llama2-7b": "llama-2-7b",
            "llama3.1-8b": "llama-3.1-8b", "mistral-7b-v0.1": "mistral-7b", "smollm2": "smollm2-135m",
            "deepseek-v3-671b": "deepseek-v3", "deepseek-llm-67b": "deepseek-67b", "deepseek-v32": "deepseek-v3.2",
            "deepseek-v4": "deepseek-v4-flash",
            "deepseek-v4.1": "deepseek-v4.1-flash"}



def preset_key(name: str) -> str:
    """A preset name or alias as looked up: lower case, without ``-``, ``_``, ``.`` or spaces."""
    return re.sub(r"[-_.\s]", "", name.lower())


PRESET_KEYS = {preset_key(n): n for n in PRESETS} | {preset_key(a): n for a, n in _ALIASES.items()}

#: Hub ids of checkpoints whose config.json has the cache shape of a preset (the preset's own id, its instruction-
#: tuned and re-released variants): planned with that preset, with no download. Compared without case.
HUB_PRESETS: dict[str, str] = {
    **{str(config["_name_or_path"]).lower(): name for name, config in PRESETS.items()},
    **{hub.lower(): name for name, hubs in {
        "llama-2-7b": ("meta-llama/Llama-2-7b", "meta-llama/Llama-2-7b-chat-hf", "meta-llama/Llama-2-7b-chat"),
        "llama-3.1-8b": ("meta-llama/Llama-3.1-8B-Instruct", "meta-llama/Meta-Llama-3.1-8B",
                         "meta-llama/Meta-Llama-3.1-8B-Instruct"),
        "mistral-7b": ("mistralai/Mistral-7B-Instruct-v0.1",),
        "qwen2.5-7b": ("Qwen/Qwen2.5-7B-Instruct",),
        "gemma-3-27b": ("google/gemma-3-27b-it",),
        "gemma3-270m": ("google/gemma-3-270m-it",),
        "smollm2-135m": ("HuggingFaceTB/SmolLM2-135M-Instruct",),
        "deepseek-67b": ("deepseek-ai/deepseek-llm-67b-chat",),
        "deepseek-v2": ("deepseek-ai/DeepSeek-V2-Chat",),
        "deepseek-v3": ("deepseek-ai/DeepSeek-V3-Base", "deepseek-ai/DeepSeek-V3-0324", "deepseek-ai/DeepSeek-R1",
                        "deepseek-ai/DeepSeek-R1-0528"),
        "deepseek-v3.2": ("deepseek-ai/DeepSeek-V3.2-Exp",),
    }.items() for hub in hubs},
}


__all__ = ["HUB_PRESETS", "PRESETS", "PRESET_KEYS", "preset_key"]
