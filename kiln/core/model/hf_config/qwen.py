"""Qwen2, Qwen3, Qwen2-MoE and Qwen3-MoE, as their transformers config classes read a config.json.

Pure: no torch import.
- Qwen2: q/k/v biases (no others); a sliding window, when use_sliding_window, on the layers from
  max_window_layers on (or as layer_types lists them: full layers, then sliding ones).
- Qwen3: per-head q/k RMSNorm; attention_bias on q, k, v and o; head_dim 128 unless given; Qwen2's window.
- Qwen2-MoE: Qwen2's attention and, as layer_types lists them, its window (Qwen2MoeConfig derives a missing
  layer_types its own way, sliding every other layer below max_window_layers, which Kiln refuses by name; it
  writes layer_types back); its `qkv_bias` flag, true by default; experts on the layers
  decoder_sparse_step and mlp_only_layers choose, top-k renormalised when norm_topk_prob; and a shared expert
  on every expert layer, weighted by a sigmoid gate.
- Qwen3-MoE: Qwen3's attention; Qwen2-MoE's routing without the shared expert; a sliding window, when
  use_sliding_window, on every layer (Qwen3MoeConfig does not read max_window_layers).
"""

from __future__ import annotations

from kiln.core.model.config import ModelConfig
from kiln.core.errors import BadInput
from kiln.core.model.hf_config.common import (COMMON_READ, EXPERTS, QK_NORM, SHARED_EXPERT, SLIDING, Family, aliased,
                                        flag, positive_int, shared_fields, silu)
from kiln.core.model.hf_config.rope import rope_fields

_WINDOW = frozenset({"use_sliding_window", "sliding_window", "max_window_layers"})
_ROUTING = frozenset({"num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                      "mlp_only_layers"})


def _window(raw: dict, family: str = "qwen2") -> dict:
    """Qwen2's sliding window: off unless use_sliding_window and a sliding_window; the layers from
    max_window_layers (28 by default) on slide, or the sliding ones of layer_types, which must come last."""
    if not flag(raw, "use_sliding_window") or raw.get("sliding_window") is None:
        return {}
    layers = raw["num_hidden_layers"]
    types = raw.get("layer_types")
    if types is None and family == "qwen2_moe":
        raise BadInput("config.json: use_sliding_window without layer_types: Qwen2MoeConfig then slides every "
                       "other layer below max_window_layers, which Kiln does not compute; list layer_types "
                       "(full-attention layers, then sliding ones).")
    if types is None:
        first = raw.get("max_window_layers", 28)
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise BadInput(f"config.json: max_window_layers={first!r} must be an integer >= 0.")
        return {"sliding_window": raw["sliding_window"], "first_sliding_layer": min(first, layers)}
    if not isinstance(types, list) or not set(types) <= {"full_attention", "sliding_attention"}:
        raise BadInput(f"config.json: layer_types={types!r} must list 'full_attention' / 'sliding_attention'.")
    first = types.index("sliding_attention") if "sliding_attention" in types else layers
    if types != ["full_attention"] * first + ["sliding_attention"] * (len(types) - first) or len(types) != layers:
        raise BadInput(f"config.json: layer_types={types!r}: Kiln computes full-attention layers followed by "
                       "sliding ones, one entry per layer.")
    return {"sliding_window": raw["sliding_window"], "first_sliding_layer": first}


def _window_hf(cfg: ModelConfig) -> dict:
    return {"use_sliding_window": cfg.sliding_window is not None, "sliding_window": cfg.sliding_window,
            "max_window_layers": cfg.first_sliding_layer}


def _experts(raw: dict, *, experts: int, per_token: int, width: int) -> dict:
    """Qwen's mixture of experts: num_experts (or num_local_experts), the top num_experts_per_tok,
    renormalised when norm_topk_prob (false by default); expert layers are those with (i + 1) a multiple of
    decoder_sparse_step, less mlp_only_layers. The keywords are the class's defaults."""
    num_experts = aliased(raw, ("num_local_experts", "num_experts"), experts)
    step = positive_int(raw, "decoder_sparse_step", 1)
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise BadInput(f"config.json: mlp_only_layers={dense!r} must list layer indices.")
    norm = raw.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise BadInput(f"config.json: norm_topk_prob={norm!r} must be true or false.")
    moe_layers = tuple(i for i in range(raw["num_hidden_layers"])
                       if i not in dense and num_experts > 0 and (i + 1) % step == 0)
    return {"num_experts": num_experts, "experts_per_token": raw.get("num_experts_per_tok", per_token),
            "moe_intermediate_size": raw.get("moe_intermediate_size", width), "norm_topk_prob": norm,
            "moe_layers": moe_layers}


def _experts_hf(cfg: ModelConfig, experts_key: str) -> dict:
    if not cfg.moe_layers:
        raise BadInput(f"a {cfg.architecture} config has mixture-of-experts layers.")
    return {experts_key: cfg.num_experts, "num_experts_per_tok": cfg.experts_per_token,
            "moe_intermediate_size": cfg.moe_intermediate_size, "norm_topk_prob": cfg.norm_topk_prob,
            "decoder_sparse_step": 1, "mlp_only_layers": [i for i in range(cfg.num_layers) if not cfg.is_moe(i)]}


def _qwen3_attention_hf(cfg: ModelConfig) -> None:
    """Qwen3's attention: q/k norms always; attention_bias on q, k, v and o together; no MLP bias."""
    if not cfg.qk_norm:
        raise BadInput(f"every {cfg.architecture} config has q/k norms (qk_norm).")
    if cfg.qkv_bias != cfg.o_bias or cfg.mlp_bias:
        raise BadInput(f"a {cfg.architecture} config's attention_bias covers q, k, v and o together; it has no "
                       "mlp_bias.")


def _qwen2(raw: dict) -> ModelConfig:
    return ModelConfig(**shared_fields(raw, "qwen2"), activation=silu(raw), qkv_bias=True, **_window(raw),
                       **rope_fields(raw, "qwen2"))


def _qwen2_to_hf(cfg: ModelConfig) -> dict:
    if not cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias:
        raise BadInput("a qwen2 config has q/k/v biases and no other biases.")
    return {"hidden_act": "silu", **_window_hf(cfg)}


QWEN2 = Family("qwen2", COMMON_READ | _WINDOW | {"layer_types"}, _qwen2, _qwen2_to_hf, features=(SLIDING,))


def _qwen3(raw: dict) -> ModelConfig:
    bias = flag(raw, "attention_bias")
    return ModelConfig(**shared_fields(raw, "qwen3", head_dim=128), activation=silu(raw), qkv_bias=bias,
                       o_bias=bias, qk_norm=True, **_window(raw), **rope_fields(raw, "qwen3"))


def _qwen3_to_hf(cfg: ModelConfig) -> dict:
    _qwen3_attention_hf(cfg)
    return {"hidden_act": "silu", **_window_hf(cfg), "attention_bias": cfg.o_bias}


QWEN3 = Family("qwen3", COMMON_READ | _WINDOW | {"attention_bias", "layer_types"}, _qwen3, _qwen3_to_hf,
               features=(QK_NORM, SLIDING))


def _qwen2_moe(raw: dict) -> ModelConfig:
    shared = positive_int(raw, "shared_expert_intermediate_size", 5632)
    return ModelConfig(**shared_fields(raw, "qwen2_moe"), activation=silu(raw), qkv_bias=flag(raw, "qkv_bias", True),
                       **_window(raw, "qwen2_moe"), **_experts(raw, experts=60, per_token=4, width=1408),
                       shared_expert_intermediate_size=shared, **rope_fields(raw, "qwen2_moe"))


def _qwen2_moe_to_hf(cfg: ModelConfig) -> dict:
    if not cfg.shared_expert_intermediate_size or cfg.o_bias or cfg.mlp_bias:
        raise BadInput("a shared expert is Qwen2-MoE's, every qwen2_moe config has one, and its only biases are "
                       "q/k/v's.")
    window = _window_hf(cfg)
    if cfg.sliding_window is not None:  # Qwen2MoeConfig would derive missing layer_types its own way
        window["layer_types"] = ["sliding_attention" if cfg.window_of(i) else "full_attention"
                                 for i in range(cfg.num_layers)]
    return {"hidden_act": "silu", **window, **_experts_hf(cfg, "num_experts"),
            "shared_expert_intermediate_size": cfg.shared_expert_intermediate_size, "qkv_bias": cfg.qkv_bias}


QWEN2_MOE = Family("qwen2_moe", COMMON_READ | _WINDOW | _ROUTING | {
    "qkv_bias", "layer_types", "num_experts", "shared_expert_intermediate_size"}, _qwen2_moe, _qwen2_moe_to_hf,
                   features=(SLIDING, EXPERTS, SHARED_EXPERT))


def _qwen3_moe(raw: dict) -> ModelConfig:
    bias = flag(raw, "attention_bias")
    window = raw.get("sliding_window", 4096) if flag(raw, "use_sliding_window") else None
    return ModelConfig(**shared_fields(raw, "qwen3_moe"), activation=silu(raw), qkv_bias=bias, o_bias=bias,
                       qk_norm=True, sliding_window=window, **_experts(raw, experts=128, per_token=8, width=768),
                       **rope_fields(raw, "qwen3_moe"))


def _qwen3_moe_to_hf(cfg: ModelConfig) -> dict:
    _qwen3_attention_hf(cfg)
    if cfg.sliding_window is not None and cfg.first_sliding_layer:
        raise BadInput("a qwen3_moe config's sliding window covers every layer.")
    return {"hidden_act": "silu", "use_sliding_window": cfg.sliding_window is not None,
            "sliding_window": cfg.sliding_window, "attention_bias": cfg.o_bias,
            **_experts_hf(cfg, "num_local_experts")}


QWEN3_MOE = Family("qwen3_moe", COMMON_READ | _WINDOW | _ROUTING | {
    "attention_bias", "num_local_experts", "num_experts"}, _qwen3_moe, _qwen3_moe_to_hf,
                   features=(QK_NORM, SLIDING, EXPERTS))
