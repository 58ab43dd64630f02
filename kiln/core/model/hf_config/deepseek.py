"""DeepSeek-V3, as transformers' DeepseekV3Config reads a config.json, with the fields of the 4.x remote
code (modeling_deepseek.py) that published DeepSeek-V3 configs carry.

Pure: no torch import.
- Multi-head latent attention: keys and values come from one latent of kv_lora_rank (plus one rotary key
  of qk_rope_head_dim shared by every head); queries through a q_lora_rank bottleneck, or one q_proj when
  q_lora_rank is null. A query/key head is qk_nope_head_dim + qk_rope_head_dim wide (ModelConfig's
  head_dim), a value head v_head_dim. config.json's own head_dim is qk_rope_head_dim and its qk_head_dim the
  sum, as DeepseekV3Config writes them. Every head reads the latent, so num_key_value_heads is
  num_attention_heads. attention_bias puts biases on q_a_proj, kv_a_proj_with_mqa and o_proj (ModelConfig's
  o_bias for latent attention). The rotated dims turn in adjacent pairs when rope_interleave (true).
- The attention scale: with a scaled rope and a non-zero mscale_all_dim, scores are scaled by
  mscale(factor, mscale_all_dim) squared on top of head_dim ** -0.5 (transformers' yarn_apply_mscale).
- Experts on layers from first_k_dense_replace on (and, with the remote code's moe_layer_freq, every
  moe_layer_freq-th): n_routed_experts, routed by sigmoid scores plus a per-expert correction bias within
  the best topk_group of n_group groups (topk_method noaux_tc, scoring_func sigmoid), renormalised when
  norm_topk_prob and scaled by routed_scaling_factor; n_shared_experts shared experts, one MLP of
  n_shared_experts x moe_intermediate_size.
"""

from __future__ import annotations

import math

from kiln.core.model.config import ModelConfig
from kiln.core.errors import BadInput
from kiln.core.model.hf_config.common import (COMMON_READ, EXPERTS, GROUPED_ROUTER, LATENT, SHARED_EXPERT, Family, aliased,
                                        flag, number, positive_int, shared_fields, silu)
from kiln.core.model.hf_config.rope import get_mscale, rope_fields, rope_scaling

_DEFAULTS = {
    "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128,
    "n_group": 8, "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3, "norm_topk_prob": True,
    "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "rope_interleave": True, "attention_bias": False,
    "max_position_embeddings": 4096,
}
"""What DeepseekV3Config (transformers 5.25) assumes for a field config.json leaves out. Not here:
n_routed_experts (256, unless num_local_experts spells it) and num_key_value_heads, which Kiln takes as
num_attention_heads when absent, as the remote code computes (the class's own default, 128, leaves a
smaller model with no key/value heads)."""

_ROUTING = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
"""The remote code's routing fields, with the one value Kiln computes; the others route as DeepSeek-V2 does."""

_INERT = {
    "num_nextn_predict_layers": "the multi-token-prediction module, used only for speculative decoding, "
                                "not in one step",
    "num_mtp_layers": "the multi-token-prediction module, used only for speculative decoding, not in one step",
    "ep_size": "how experts are placed over devices (same math)",
    "aux_loss_alpha": "a training loss weight", "seq_aux": "a training loss setting",
    "auto_map": "where the remote code lives; its math is transformers' DeepseekV3 classes'",
}
"""Fields inert for DeepSeek-V3, with why."""


def int_at_least(raw: dict, name: str, least: int) -> int:
    value = raw[name]
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise BadInput(f"config.json: {name}={value!r} must be an integer >= {least}.")
    return value


def attention_scale(raw: dict, rope: dict) -> float:
    """transformers' yarn_apply_mscale: mscale(factor, mscale_all_dim) squared for a scaled rope with a non-zero
    mscale_all_dim, else 1. `rope` is rope_fields' reading of `raw`."""
    params = raw.get("rope_parameters")
    params = params if params is not None else raw.get("rope_scaling") or {}
    if rope["rope_type"] == "default" or not params.get("mscale_all_dim"):
        return 1.0
    mscale = get_mscale(rope["rope_factor"], number(params, "mscale_all_dim", 0.0))
    return mscale * mscale


def latent_fields(raw: dict) -> dict:
    """ModelConfig's latent-attention fields; head_dim and qk_head_dim only as DeepseekV3Config writes them."""
    nope, rope = positive_int(raw, "qk_nope_head_dim", 0), positive_int(raw, "qk_rope_head_dim", 0)
    for name, value in (("head_dim", rope), ("qk_head_dim", nope + rope)):
        if name in raw and raw[name] != value:
            raise BadInput(f"config.json: {name}={raw[name]!r}: DeepseekV3Config sets head_dim to qk_rope_head_dim "
                           f"({rope}) and qk_head_dim to qk_nope_head_dim + qk_rope_head_dim ({nope + rope}); a file "
                           "that says otherwise was not written for this model.")
    q_rank = raw["q_lora_rank"]
    return {"head_dim": nope + rope, "qk_rope_head_dim": rope,
            "kv_lora_rank": positive_int(raw, "kv_lora_rank", 0), "v_head_dim": positive_int(raw, "v_head_dim", 0),
            "q_lora_rank": 0 if q_rank is None else positive_int(raw, "q_lora_rank", 0),
            "rope_interleave": flag(raw, "rope_interleave")}


def expert_fields(raw: dict) -> dict:
    """ModelConfig's mixture-of-experts and routing fields."""
    for name, value in _ROUTING.items():
        if name in raw and raw[name] != value:
            raise BadInput(f"config.json: {name}={raw[name]!r}: Kiln computes DeepSeek-V3's routing only "
                           "(topk_method 'noaux_tc', scoring_func 'sigmoid': sigmoid scores, a correction bias, the "
                           "best topk_group of n_group groups); other routings are DeepSeek-V2's.")
    names = ("n_routed_experts", "num_local_experts")
    experts = aliased(raw, names, None if any(k in raw for k in names) else 256)
    width = positive_int(raw, "moe_intermediate_size", 0)
    layers = positive_int(raw, "num_hidden_layers", 0)
    first, step = int_at_least(raw, "first_k_dense_replace", 0), positive_int(raw, "moe_layer_freq", 1)
    shared = 0 if raw["n_shared_experts"] is None else int_at_least(raw, "n_shared_experts", 0)
    return {"num_experts": positive_int({"n_routed_experts": experts}, "n_routed_experts", 0),
            "experts_per_token": positive_int(raw, "num_experts_per_tok", 0), "moe_intermediate_size": width,
            "norm_topk_prob": flag(raw, "norm_topk_prob"),
            "moe_layers": tuple(i for i in range(layers) if i >= first and i % step == 0),
            "shared_expert_intermediate_size": width * shared, "router": "sigmoid_groups",
            "num_expert_groups": 1 if raw["n_group"] is None else positive_int(raw, "n_group", 0),
            "topk_groups": 1 if raw["topk_group"] is None else positive_int(raw, "topk_group", 0),
            "routed_scaling_factor": number(raw, "routed_scaling_factor", 0.0)}


def _deepseek_v3(raw: dict) -> ModelConfig:
    raw = {**_DEFAULTS, **raw}
    rope = rope_fields(raw, "deepseek_v3")
    return ModelConfig(**{**shared_fields(raw, "deepseek_v3"), **latent_fields(raw)}, activation=silu(raw),
                       o_bias=flag(raw, "attention_bias"), **expert_fields(raw), **rope,
                       attn_scale_multiplier=attention_scale(raw, rope))


def _layer_rule(cfg: ModelConfig) -> tuple[int, int]:
    """(first_k_dense_replace, moe_layer_freq) that choose cfg's expert layers."""
    if not cfg.moe_layers:
        return cfg.num_layers, 1
    first = cfg.moe_layers[0]
    for step in range(1, cfg.num_layers + 1):
        if tuple(i for i in range(cfg.num_layers) if i >= first and i % step == 0) == cfg.moe_layers:
            return first, step
    raise BadInput(f"a deepseek_v3 config's expert layers are every layer from first_k_dense_replace on (every "
                   f"moe_layer_freq-th with the remote code's moe_layer_freq), not {list(cfg.moe_layers)}.")


def mscale_all_dim(cfg: ModelConfig) -> float:
    """The mscale_all_dim that from_hf reads back as cfg.attn_scale_multiplier: the inverse of mscale squared,
    rounded to 12 digits when that reads back exactly (1.0 rather than 0.9999999999999999), else the nearest
    float that does."""
    factor, target = cfg.rope_factor, cfg.attn_scale_multiplier
    if cfg.rope_type != "yarn" or not factor > 1:
        raise BadInput("a deepseek_v3 config's attention scale multiplier is yarn's mscale(factor, mscale_all_dim) "
                       "squared: it needs rope type yarn with a factor above 1.")
    guess = (math.sqrt(target) - 1.0) / (0.1 * math.log(factor))
    for candidate in [float(f"{guess:.12g}"), *_neighbours(guess, 64)]:
        mscale = get_mscale(factor, candidate)
        if candidate and mscale * mscale == target:
            return candidate
    raise BadInput(f"attn_scale_multiplier={target!r} is no yarn mscale(factor {factor}, mscale_all_dim) squared.")


def _neighbours(x: float, count: int) -> list[float]:
    """x, then the floats next to it on either side, nearest first."""
    out, up, down = [x], x, x
    for _ in range(count):
        up, down = math.nextafter(up, math.inf), math.nextafter(down, -math.inf)
        out += [up, down]
    return out


def _deepseek_v3_to_hf(cfg: ModelConfig) -> dict:
    if not cfg.latent:
        raise BadInput("every deepseek_v3 config has latent attention (kv_lora_rank).")
    if cfg.qkv_bias or cfg.mlp_bias:
        raise BadInput("a deepseek_v3 config's attention_bias is on q_a_proj, kv_a_proj_with_mqa and o_proj "
                       "(o_bias); it has no q/k/v or MLP biases.")
    if cfg.router != "sigmoid_groups" or min(cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size) <= 0 \
            or cfg.shared_expert_intermediate_size % cfg.moe_intermediate_size:
        raise BadInput("a deepseek_v3 config routes by sigmoid scores within groups (router sigmoid_groups) to "
                       "experts of moe_intermediate_size, and its shared expert is a whole number of them.")
    first, step = _layer_rule(cfg)
    rope = {}
    if cfg.attn_scale_multiplier != 1.0:
        all_dim = mscale_all_dim(cfg)
        rope["rope_scaling"] = {**rope_scaling(cfg), "mscale_all_dim": all_dim}
    return {"head_dim": cfg.qk_rope_head_dim, **rope, "hidden_act": "silu", "qk_head_dim": cfg.head_dim,
            **latent_and_experts_hf(cfg), **_ROUTING, "first_k_dense_replace": first,
            **({"moe_layer_freq": step} if step != 1 else {})}


def latent_and_experts_hf(cfg: ModelConfig) -> dict:
    """The latent attention's and the grouped experts' fields of a config.json, as DeepSeek-V3 and Mistral 4
    spell them."""
    return {"kv_lora_rank": cfg.kv_lora_rank, "q_lora_rank": cfg.q_lora_rank or None,
            "qk_rope_head_dim": cfg.qk_rope_head_dim, "qk_nope_head_dim": cfg.qk_nope_head_dim,
            "v_head_dim": cfg.v_head_dim, "rope_interleave": cfg.rope_interleave, "attention_bias": cfg.o_bias,
            "n_routed_experts": cfg.num_experts, "num_experts_per_tok": cfg.experts_per_token,
            "moe_intermediate_size": cfg.moe_intermediate_size,
            "n_shared_experts": cfg.shared_expert_intermediate_size // cfg.moe_intermediate_size,
            "routed_scaling_factor": cfg.routed_scaling_factor, "n_group": cfg.num_expert_groups,
            "topk_group": cfg.topk_groups, "norm_topk_prob": cfg.norm_topk_prob}


DEEPSEEK_V3 = Family(
    "deepseek_v3",
    COMMON_READ | {"qk_head_dim", "kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                   "rope_interleave", "attention_bias", "n_routed_experts", "num_local_experts",
                   "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts", "routed_scaling_factor",
                   "n_group", "topk_group", "first_k_dense_replace", "moe_layer_freq", "norm_topk_prob",
                   *_ROUTING},
    _deepseek_v3, _deepseek_v3_to_hf, features=(EXPERTS, SHARED_EXPERT, LATENT, GROUPED_ROUTER), required=(),
    inert=_INERT)
