"""Llama 4's text decoder, as Llama4TextConfig reads a config.json (model_type llama4_text).

Pure: no torch import. Grouped-query attention (attention_bias on q, k, v and o together); the layers that rotate
(no_rope_layers' ones, by default all but every no_rope_layer_interval-th) turn adjacent pairs of dims and
normalise q and k without a weight (use_qk_norm), attending within chunks of attention_chunk_size positions;
the others attend to everything, unrotated, their queries scaled by the attention temperature
(attn_temperature_tuning, floor_scale, attn_scale). layer_types, when given, must say what Llama4TextConfig
derives (chunked exactly where the layer rotates). The layers of moe_layers (by default every
interleave_moe_layer_step-th) are a mixture of num_local_experts experts of width intermediate_size, top
num_experts_per_tok of the router's logits, each chosen expert's sigmoid scaling its input, with a shared expert
as wide; the others a dense MLP of width intermediate_size_mlp. The experts are fused 3-D tensors, input-major
(kiln.core.model.fused_experts). A field config.json leaves out takes Llama4TextConfig's default (Llama 4
Scout's sizes); the rope's theta defaults to 500000.
"""

from __future__ import annotations

from kiln.core.errors import BadInput
from kiln.core.model.config import ModelConfig
from kiln.core.model.hf_config.common import (COMMON_READ, EXPERTS, SHARED_EXPERT, Family, flag, number,
                                              positive_int, shared_fields, silu)
from kiln.core.model.hf_config.rope import rope_fields
from kiln.core.model.llama4_fields import ARCHITECTURE, ROUTER

_DEFAULTS = {"vocab_size": 202048, "hidden_size": 5120, "intermediate_size": 8192, "intermediate_size_mlp": 16384,
             "num_hidden_layers": 48, "num_attention_heads": 40, "num_key_value_heads": 8, "head_dim": 128,
             "rms_norm_eps": 1e-5, "num_experts_per_tok": 1, "num_local_experts": 16, "interleave_moe_layer_step": 1,
             "no_rope_layer_interval": 4, "attention_chunk_size": 8192, "floor_scale": 8192, "attn_scale": 0.1}
"""Llama4TextConfig's defaults (transformers 5.25) for the fields that have one that is not null or false."""
_THETA = 500000.0
_INERT = {"for_llm_compressor": "a flag for llm-compressor's tracing; the model computes the same"}


def _layer_lists(raw: dict, layers: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(the layers with no rope, the expert layers) as Llama4TextConfig derives them; layer_types checked."""
    rope = raw.get("no_rope_layers") or [int((i + 1) % positive_int(raw, "no_rope_layer_interval", 4) != 0)
                                         for i in range(layers)]
    if not isinstance(rope, list) or len(rope) != layers or any(v not in (0, 1) or isinstance(v, float)
                                                                 for v in rope):
        raise BadInput(f"config.json: no_rope_layers={rope!r} must list 1 (the layer rotates) or 0 for each of the "
                       f"{layers} layers.")
    chunk = raw.get("attention_chunk_size")
    derived = ["chunked_attention" if r and chunk is not None else "full_attention" for r in rope]
    types = raw.get("layer_types")
    if types is not None and types != derived:
        raise BadInput(f"config.json: layer_types={types!r}: Kiln computes Llama 4 with chunked attention exactly on "
                       f"the layers that rotate (no_rope_layers), as Llama4TextConfig derives it: {derived!r}.")
    moe = raw.get("moe_layers")
    if moe is None:
        step = positive_int(raw, "interleave_moe_layer_step", 1)
        moe = list(range(step - 1, layers, step))
    if not isinstance(moe, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in moe):
        raise BadInput(f"config.json: moe_layers={moe!r} must list layer indices.")
    return tuple(i for i, r in enumerate(rope) if not r), tuple(sorted(set(moe)))


def _temperature(raw: dict) -> dict:
    """ModelConfig's temperature fields: attn_temperature_tuning is read as Llama4TextAttention tests it (truthy)."""
    tuning = raw.get("attn_temperature_tuning", True)
    if not isinstance(tuning, (bool, int)) and tuning is not None:
        raise BadInput(f"config.json: attn_temperature_tuning={tuning!r} must be true or false.")
    if not tuning:
        return {}
    return {"temperature_floor": positive_int(raw, "floor_scale", 8192),
            "temperature_scale": number(raw, "attn_scale", 0.1)}


def _llama4(raw: dict) -> ModelConfig:
    raw = {**_DEFAULTS, **raw}  # a null is read as Llama4TextConfig reads it (no chunks; head_dim from the widths)
    layers = positive_int(raw, "num_hidden_layers", 0)
    nope, moe = _layer_lists(raw, layers)
    chunk = raw.get("attention_chunk_size")
    width = positive_int(raw, "intermediate_size", 0)
    bias = flag(raw, "attention_bias")
    fields = shared_fields({**raw, "intermediate_size": raw["intermediate_size_mlp"]}, ARCHITECTURE,
                           rms_norm_eps=1e-5)
    return ModelConfig(**fields, activation=silu(raw), qkv_bias=bias, o_bias=bias, attention_chunk_size=chunk,
                       nope_layers=nope, qk_l2_norm=flag(raw, "use_qk_norm", True), **_temperature(raw),
                       num_experts=raw["num_local_experts"], experts_per_token=raw["num_experts_per_tok"],
                       moe_intermediate_size=width, shared_expert_intermediate_size=width if moe else 0,
                       norm_topk_prob=False, moe_layers=moe, router=ROUTER, **rope_fields(raw, ARCHITECTURE, _THETA))


def _llama4_to_hf(cfg: ModelConfig) -> dict:
    if cfg.qkv_bias != cfg.o_bias or cfg.mlp_bias or (cfg.moe_layers and (
            cfg.router != ROUTER or cfg.shared_expert_intermediate_size != cfg.moe_intermediate_size)):
        raise BadInput("a llama4_text config's attention_bias covers q, k, v and o together, it has no mlp_bias, "
                       "and its experts (routed by their sigmoid-scaled inputs) have a shared expert as wide.")
    return {"hidden_act": "silu", "attention_bias": cfg.o_bias, "intermediate_size": cfg.moe_intermediate_size,
            "intermediate_size_mlp": cfg.intermediate_size, "attention_chunk_size": cfg.attention_chunk_size,
            "no_rope_layers": [int(i not in cfg.nope_layers) for i in range(cfg.num_layers)],
            "use_qk_norm": cfg.qk_l2_norm, "attn_temperature_tuning": bool(cfg.temperature_floor),
            "floor_scale": cfg.temperature_floor or 8192, "attn_scale": cfg.temperature_scale or 0.1,
            "moe_layers": list(cfg.moe_layers), "num_local_experts": cfg.num_experts or 16,
            "num_experts_per_tok": cfg.experts_per_token or 1}


LLAMA4_TEXT = Family(
    ARCHITECTURE,
    COMMON_READ | {"intermediate_size_mlp", "attention_bias", "attention_chunk_size", "layer_types", "no_rope_layers",
                   "no_rope_layer_interval", "use_qk_norm", "attn_temperature_tuning", "floor_scale", "attn_scale",
                   "moe_layers", "interleave_moe_layer_step", "num_local_experts", "num_experts_per_tok"},
    _llama4, _llama4_to_hf, features=(EXPERTS, SHARED_EXPERT), required=(), inert=_INERT)
