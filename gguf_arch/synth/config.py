"""The `config.json` of a synthetic Kimi K3 / K3.1-Pro checkpoint, in the released file's layout.

The released file is a multimodal wrapper (`KimiK3ForConditionalGeneration`) around a
`kimi_linear` `text_config` that also carries generation boilerplate and the compressed-tensors
`quantization_config`. A synthetic checkpoint keeps every one of those keys with the released
values and changes only sizes and token ids, so readers meet exactly what the real file holds.

Dimensions are named by short CLI-style keys (`hidden`, `experts`, ...); `DIMENSIONS` maps each
to the config field it sets.
"""
from __future__ import annotations

from typing import Any

from ..arch.config_fields import MXFP4_FORMAT
from ..arch.mxfp4 import BLOCK

# CLI key -> (section, field). Sections: text_config, its linear_attn_config, the K3.1-Pro
# index_* fields (written only for k31pro).
DIMENSIONS: dict[str, tuple[str, str]] = {
    "layers": ("text", "num_hidden_layers"),
    "hidden": ("text", "hidden_size"),
    "vocab": ("text", "vocab_size"),
    "intermediate": ("text", "intermediate_size"),
    "dense-layers": ("text", "first_k_dense_replace"),
    "experts": ("text", "num_experts"),
    "experts-per-token": ("text", "num_experts_per_token"),
    "shared-experts": ("text", "num_shared_experts"),
    "moe-intermediate": ("text", "moe_intermediate_size"),
    "latent": ("text", "routed_expert_hidden_size"),
    "mla-heads": ("text", "num_attention_heads"),
    "q-lora": ("text", "q_lora_rank"),
    "kv-lora": ("text", "kv_lora_rank"),
    "qk-nope": ("text", "qk_nope_head_dim"),
    "qk-rope": ("text", "qk_rope_head_dim"),
    "v-head-dim": ("text", "v_head_dim"),
    "attn-res-block": ("text", "attn_res_block_size"),
    "kda-heads": ("kda", "num_heads"),
    "kda-head-dim": ("kda", "head_dim"),
    "conv-kernel": ("kda", "short_conv_kernel_size"),
    "index-heads": ("index", "index_n_heads"),
    "index-head-dim": ("index", "index_head_dim"),
    "index-topk": ("index", "index_topk"),
}

# The tiny preset has the shared fixtures' sizes (hidden 64, 13 layers, 8 experts): small enough
# to generate and convert in about a second, deep enough to hold every layer kind.
TINY: dict[str, int] = {
    "layers": 13, "hidden": 64, "vocab": 912, "intermediate": 128, "dense-layers": 1,
    "experts": 8, "experts-per-token": 2, "shared-experts": 2, "moe-intermediate": 32, "latent": 64,
    "mla-heads": 4, "q-lora": 32, "kv-lora": 32, "qk-nope": 16, "qk-rope": 8, "v-head-dim": 16,
    "attn-res-block": 4, "kda-heads": 4, "kda-head-dim": 16, "conv-kernel": 4,
    "index-heads": 4, "index-head-dim": 16, "index-topk": 2048,
}

# The large preset has the real model's sizes except depth, expert count and vocabulary: dense
# layer 0 (KDA), KDA+MoE layers 1-2, MLA(+DSA)+MoE layer 3; about 9 GB, for benchmarks.
LARGE: dict[str, int] = {
    "layers": 4, "hidden": 7168, "vocab": 912, "intermediate": 33792, "dense-layers": 1,
    "experts": 64, "experts-per-token": 8, "shared-experts": 2, "moe-intermediate": 3072, "latent": 3584,
    "mla-heads": 96, "q-lora": 1536, "kv-lora": 512, "qk-nope": 128, "qk-rope": 64, "v-head-dim": 128,
    "attn-res-block": 12, "kda-heads": 96, "kda-head-dim": 128, "conv-kernel": 4,
    "index-heads": 32, "index-head-dim": 128, "index-topk": 2048,
}

PRESETS = {"tiny": TINY, "large": LARGE}
VARIANTS = ("k3", "k31pro")

# K3 interleaves 3 KDA layers and 1 full-attention (MLA) layer, and its last layer is MLA.
_FULL_ATTN_PERIOD = 4

# Offsets of the named special tokens in the 256-slot block that follows the BPE ranks.
SPECIAL_OFFSETS: dict[int, str] = {
    0: "[BOS]", 1: "[EOS]", 2: "<|end_of_msg|>", 3: "<|open|>", 4: "<|close|>", 5: "<|sep|>",
    6: "[start_header_id]", 7: "[end_header_id]", 9: "[EOT]", 18: "<|media_begin|>",
    19: "<|media_content|>", 20: "<|media_end|>", 21: "<|media_pad|>", 65: "<osagent_mode>",
    254: "[UNK]", 255: "[PAD]",
}
SPECIAL_SLOTS = 256
BOS_OFFSET, TURN_END_OFFSET, MEDIA_PAD_OFFSET, PAD_OFFSET = 0, 2, 21, 255

_QUANTIZATION: dict[str, Any] = {
    "config_groups": {"group_0": {
        "format": MXFP4_FORMAT, "input_activations": None, "output_activations": None,
        "targets": ["Linear"],
        "weights": {"actorder": None, "block_structure": None, "dynamic": False, "group_size": BLOCK,
                    "num_bits": 4, "observer": "minmax", "observer_kwargs": {},
                    "scale_dtype": "torch.uint8", "strategy": "group", "symmetric": True, "type": "float",
                    "zp_dtype": None},
    }},
    "format": MXFP4_FORMAT, "global_compression_ratio": None,
    "ignore": ["re:.*self_attn.*", "re:.*shared_experts.*", "re:.*mlp\\.(gate|up|gate_up|down)_proj.*",
               "re:.*lm_head.*", "re:.*vision_tower.*", "re:.*mm_projector.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
}

# text_config keys of the released file that are not sizes or token ids, with its values.
_TEXT_BOILERPLATE: dict[str, Any] = {
    "_name_or_path": "", "activation_situ_beta": 4.0, "activation_situ_linear_beta": 25.0,
    "add_cross_attention": False, "architectures": ["KimiLinearForCausalLM"],
    "auto_map": {"AutoConfig": "configuration_kimi_k3.KimiLinearConfig",
                 "AutoModel": "modeling_kimi_linear.KimiLinearModel",
                 "AutoModelForCausalLM": "modeling_kimi_linear.KimiLinearForCausalLM"},
    "bad_words_ids": None, "begin_suppress_tokens": None, "chunk_size_feed_forward": 0,
    "cross_attention_hidden_size": None, "decoder_start_token_id": None, "diversity_penalty": 0.0,
    "do_sample": False, "dtype": "bfloat16", "early_stopping": False, "encoder_no_repeat_ngram_size": 0,
    "exponential_decay_length_penalty": None, "finetuning_task": None, "forced_bos_token_id": None,
    "forced_eos_token_id": None, "hidden_act": "situ", "id2label": {"0": "LABEL_0", "1": "LABEL_1"},
    "initializer_range": 0.02, "is_decoder": False, "is_encoder_decoder": False,
    "label2id": {"LABEL_0": 0, "LABEL_1": 1}, "latent_moe_use_norm": True, "length_penalty": 1.0,
    "max_length": 20, "max_position_embeddings": 1048576, "min_length": 0, "mla_use_nope": True,
    "mla_use_output_gate": True, "model_type": "kimi_linear", "moe_layer_freq": 1, "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid", "no_repeat_ngram_size": 0, "num_beam_groups": 1,
    "num_beams": 1, "num_expert_group": 1, "num_nextn_predict_layers": 0, "num_return_sequences": 1,
    "output_attentions": False, "output_hidden_states": False, "output_scores": False, "prefix": None,
    "problem_type": None, "pruned_heads": {}, "quantization_config": _QUANTIZATION,
    "remove_invalid_values": False, "repetition_penalty": 1.0, "return_dict": True,
    "return_dict_in_generate": False, "rms_norm_eps": 1e-05, "routed_scaling_factor": 1.0,
    "sep_token_id": None, "suppress_tokens": None, "task_specific_params": None, "temperature": 1.0,
    "tf_legacy_loss": False, "tie_encoder_decoder": False, "tie_word_embeddings": False,
    "tokenizer_class": None, "top_k": 50, "top_p": 1.0, "topk_group": 1, "topk_method": "noaux_tc",
    "torchscript": False, "transformers_version": "4.56.2", "typical_p": 1.0, "use_bfloat16": False,
    "use_cache": True, "use_grouped_topk": True,
}

_KDA_BOILERPLATE: dict[str, Any] = {"gate_lower_bound": -5.0, "use_full_rank_gate": True}

# The fixtures' tiny vision tower; only its text-side width follows the text model.
_VISION: dict[str, Any] = {
    "_attn_implementation": "flash_attention_2", "activation_func": "gelu_pytorch_tanh", "attn_bias": False,
    "init_pos_emb_height": 8, "init_pos_emb_time": 4, "init_pos_emb_width": 8, "linear_bias": False,
    "merge_kernel_size": [2, 2], "merge_type": "sd2_tpool", "mlp_type": "mlp2", "mm_hidden_size": 32,
    "mm_projector_type": "patchmergerv2", "norm_type": "rmsnorm", "patch_embed_proj_bias": False,
    "patch_size": 4, "pos_emb_interpolation_mode": "bilinear", "pos_emb_type": "divided_fixed",
    "projector_hidden_act": "gelu", "projector_ln_eps": 1e-05, "qkv_hidden_size": 32, "vt_hidden_size": 32,
    "vt_intermediate_size": 64, "vt_num_attention_heads": 2, "vt_num_hidden_layers": 2,
}

_TOP_BOILERPLATE: dict[str, Any] = {
    "architectures": ["KimiK3ForConditionalGeneration"],
    "auto_map": {"AutoConfig": "configuration_kimi_k3.KimiK3Config",
                 "AutoModel": "modeling_kimi_k3.KimiK3ForConditionalGeneration",
                 "AutoModelForCausalLM": "modeling_kimi_k3.KimiK3ForConditionalGeneration"},
    "dtype": "bfloat16", "ignore_index": -100, "image_placeholder": "<|kimi_image_placeholder|>",
    "model_type": "kimi_k3", "tie_word_embeddings": False,
}


def layer_lists(n_layers: int) -> tuple[list[int], list[int]]:
    """1-based (kda_layers, full_attn_layers): every 4th layer and the last one are MLA."""
    full = [l for l in range(1, n_layers + 1) if l % _FULL_ATTN_PERIOD == 0 or l == n_layers]
    kda = [l for l in range(1, n_layers + 1) if l not in full]
    return kda, full


def token_ids(vocab_size: int) -> dict[str, int]:
    """bos/eos/pad/media ids in the special block at the end of the vocabulary.

    As in the released config, `eos_token_id` is the turn terminator `<|end_of_msg|>`.
    """
    base = vocab_size - SPECIAL_SLOTS
    return {"bos_token_id": base + BOS_OFFSET, "eos_token_id": base + TURN_END_OFFSET,
            "pad_token_id": base + PAD_OFFSET, "media_placeholder_token_id": base + MEDIA_PAD_OFFSET}


def build_config(dims: dict[str, int], variant: str) -> dict[str, Any]:
    """The full config.json dict for `dims` (every key of DIMENSIONS) and variant k3 / k31pro."""
    fields: dict[str, dict[str, int]] = {"text": {}, "kda": {}, "index": {}}
    for key, (section, field) in DIMENSIONS.items():
        fields[section][field] = dims[key]
    kda_layers, full_layers = layer_lists(dims["layers"])
    ids = token_ids(dims["vocab"])
    text_ids = {k: v for k, v in ids.items() if k != "media_placeholder_token_id"}
    text: dict[str, Any] = {**_TEXT_BOILERPLATE, **fields["text"], **text_ids,
                            "num_key_value_heads": dims["mla-heads"],
                            "linear_attn_config": {**_KDA_BOILERPLATE, **fields["kda"], "kda_layers": kda_layers,
                                                   "full_attn_layers": full_layers}}
    if variant == "k31pro":
        text.update(fields["index"], index_layers=list(full_layers))
    return {**_TOP_BOILERPLATE, **ids, "text_config": text,
            "vision_config": {**_VISION, "text_hidden_size": dims["hidden"]}}
