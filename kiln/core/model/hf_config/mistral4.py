"""Mistral 4, as Mistral4Config reads a config.json.

Pure: no torch import. DeepSeek-V3's latent attention (a q_lora_rank bottleneck, a kv_lora_rank latent with one
rotary key of qk_rope_head_dim, rotary pairs interleaved by default), its queries scaled by
1 + llama_4_scaling_beta x log(1 + floor(position / original_max_position_embeddings)) and its scores by yarn's
mscale(factor, mscale_all_dim) squared; layers from first_k_dense_replace on are a mixture of experts routed by
a softmax (in the model's dtype) within the best topk_group of n_group groups, renormalised and scaled, with
n_shared_experts shared experts beside; the experts stored as Mistral4Experts holds them, fused 3-D tensors
(kiln.core.model.fused_experts). config.json's head_dim and qk_head_dim are qk_nope_head_dim + qk_rope_head_dim;
num_key_value_heads is inert (every head reads the latent). The rope is yarn, its rope_parameters carrying
llama_4_scaling_beta, partial_rotary_factor (qk_rope_head_dim over head_dim) and max_position_embeddings too.
A field config.json leaves out takes Mistral4Config's default (Mistral Small 4's sizes).
"""

from __future__ import annotations

from kiln.core.model.config import ModelConfig
from kiln.core.errors import BadInput
from kiln.core.model.hf_config.common import (COMMON_READ, EXPERTS, GROUPED_ROUTER, LATENT, SHARED_EXPERT, Family,
                                              aliased, flag, number, positive_int, shared_fields, silu)
from kiln.core.model.hf_config.deepseek import attention_scale, int_at_least, mscale_all_dim, latent_and_experts_hf
from kiln.core.model.hf_config.rope import rope_fields, rope_scaling

_DEFAULTS = {
    "vocab_size": 131072, "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 2048,
    "num_hidden_layers": 36, "num_attention_heads": 32, "n_shared_experts": 1, "n_routed_experts": 128,
    "routed_scaling_factor": 1.0, "kv_lora_rank": 256, "q_lora_rank": 1024, "qk_rope_head_dim": 64,
    "v_head_dim": 128, "qk_nope_head_dim": 64, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 4,
    "first_k_dense_replace": 0, "norm_topk_prob": True, "rms_norm_eps": 1e-6, "rope_interleave": True,
    "attention_bias": False, "max_position_embeddings": 1048576,
}
"""Mistral4Config's defaults (transformers 5.25)."""
_ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 128.0, "original_max_position_embeddings": 8192,
         "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}
"""Mistral4Config's rope when config.json gives none."""
_INERT = {"num_key_value_heads": "every head reads the one latent (Mistral4Attention never reads it)"}


def _rope(raw: dict) -> tuple[dict, float]:
    """(config.json with its rope as rope_fields reads it, llama_4_scaling_beta): the rope's own keys that are not
    yarn's (llama_4_scaling_beta, max_position_embeddings, partial_rotary_factor) taken out and checked."""
    where = "rope_parameters" if raw.get("rope_parameters") is not None else "rope_scaling"
    rope = raw.get(where)
    rope = dict(_ROPE if rope is None and raw.get("rope_scaling") is None else rope or {})
    if not isinstance(rope, dict):
        raise BadInput(f"config.json: {where}={rope!r} must be an object.")
    if rope.get("rope_type", rope.get("type")) != "yarn" or "llama_4_scaling_beta" not in rope:
        raise BadInput(f"config.json: {where}={rope!r}: Mistral4Attention scales its queries by the rope's "
                       "llama_4_scaling_beta over its original_max_position_embeddings; Kiln reads Mistral 4's yarn "
                       "rope with both, as Mistral4Config writes it.")
    beta = number(rope, "llama_4_scaling_beta", 0.0)
    rope.pop("llama_4_scaling_beta")
    rope.pop("max_position_embeddings", None)  # a documented limit, as the top-level one
    rotated = raw["qk_rope_head_dim"] / (raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"])
    factor = rope.pop("partial_rotary_factor", rotated)
    if not isinstance(factor, (int, float)) or abs(factor - rotated) > 1e-9:
        raise BadInput(f"config.json: {where}.partial_rotary_factor={factor!r}: Mistral 4 rotates qk_rope_head_dim of "
                       f"each head's qk_nope_head_dim + qk_rope_head_dim dims ({rotated!r}).")
    rest = {k: v for k, v in raw.items() if k not in ("rope_parameters", "rope_scaling")}
    return {**rest, "rope_parameters": rope}, beta


def _latent(raw: dict) -> dict:
    """ModelConfig's latent-attention fields; head_dim and qk_head_dim only as Mistral4Config writes them."""
    nope, rope = positive_int(raw, "qk_nope_head_dim", 0), positive_int(raw, "qk_rope_head_dim", 0)
    for name in ("head_dim", "qk_head_dim"):
        if name in raw and raw[name] != nope + rope:
            raise BadInput(f"config.json: {name}={raw[name]!r}: Mistral4Config sets it to qk_nope_head_dim + "
                           f"qk_rope_head_dim ({nope + rope}); a file that says otherwise was not written for it.")
    q_rank = raw["q_lora_rank"]
    return {"head_dim": nope + rope, "qk_rope_head_dim": rope, "num_kv_heads": raw["num_attention_heads"],
            "kv_lora_rank": positive_int(raw, "kv_lora_rank", 0), "v_head_dim": positive_int(raw, "v_head_dim", 0),
            "q_lora_rank": 0 if q_rank is None else positive_int(raw, "q_lora_rank", 0),
            "rope_interleave": flag(raw, "rope_interleave")}


def _experts(raw: dict) -> dict:
    """ModelConfig's mixture-of-experts and routing fields."""
    width = positive_int(raw, "moe_intermediate_size", 0)
    first = int_at_least(raw, "first_k_dense_replace", 0)
    shared = 0 if raw["n_shared_experts"] is None else int_at_least(raw, "n_shared_experts", 0)
    experts = aliased(raw, ("n_routed_experts", "num_local_experts"), 128)
    return {"num_experts": positive_int({"n_routed_experts": experts}, "n_routed_experts", 0),
            "experts_per_token": positive_int(raw, "num_experts_per_tok", 0), "moe_intermediate_size": width,
            "norm_topk_prob": flag(raw, "norm_topk_prob"),
            "moe_layers": tuple(range(first, positive_int(raw, "num_hidden_layers", 0))),
            "shared_expert_intermediate_size": width * shared, "router": "softmax_groups",
            "num_expert_groups": 1 if raw["n_group"] is None else positive_int(raw, "n_group", 0),
            "topk_groups": 1 if raw["topk_group"] is None else positive_int(raw, "topk_group", 0),
            "routed_scaling_factor": number(raw, "routed_scaling_factor", 0.0)}


def _mistral4(raw: dict) -> ModelConfig:
    raw = {**_DEFAULTS, **{k: v for k, v in raw.items() if v is not None or k not in _DEFAULTS}}
    latent = _latent(raw)
    read, beta = _rope(raw)
    rope = rope_fields(read, "mistral4")
    fields = {**shared_fields(read, "mistral4"), **latent}
    return ModelConfig(**fields, activation=silu(raw), o_bias=flag(raw, "attention_bias"), **_experts(raw), **rope,
                       attn_scale_multiplier=attention_scale(read, rope), query_scale_beta=beta)


def _mistral4_to_hf(cfg: ModelConfig) -> dict:
    if not cfg.latent or cfg.router != "softmax_groups" or cfg.rope_type != "yarn" or cfg.qkv_bias or cfg.mlp_bias:
        raise BadInput("a mistral4 config has latent attention, a yarn rope, experts routed by a softmax within "
                       "groups, and no q/k/v or MLP biases.")
    first = cfg.moe_layers[0] if cfg.moe_layers else cfg.num_layers
    if cfg.moe_layers != tuple(range(first, cfg.num_layers)) or cfg.shared_expert_intermediate_size % (
            cfg.moe_intermediate_size or 1):
        raise BadInput("a mistral4 config's experts fill every layer from first_k_dense_replace on, and its shared "
                       "expert is a whole number of experts wide.")
    rope = {**rope_scaling(cfg), "llama_4_scaling_beta": cfg.query_scale_beta,
            "partial_rotary_factor": cfg.qk_rope_head_dim / cfg.head_dim}
    if cfg.attn_scale_multiplier != 1.0:
        rope["mscale_all_dim"] = mscale_all_dim(cfg)
    return {"head_dim": cfg.head_dim, "qk_head_dim": cfg.head_dim, "hidden_act": "silu", "rope_scaling": None,
            "rope_theta": cfg.rope_theta, "rope_parameters": {**rope, "rope_theta": cfg.rope_theta},
            **latent_and_experts_hf(cfg), "first_k_dense_replace": first}


MISTRAL4 = Family(
    "mistral4",
    COMMON_READ | {"qk_head_dim", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                   "rope_interleave", "attention_bias", "n_routed_experts", "num_local_experts", "num_experts_per_tok",
                   "moe_intermediate_size", "n_shared_experts", "routed_scaling_factor", "n_group", "topk_group",
                   "first_k_dense_replace", "norm_topk_prob"},
    _mistral4, _mistral4_to_hf, features=(EXPERTS, SHARED_EXPERT, LATENT, GROUPED_ROUTER), required=(),
    inert=_INERT)
