"""Gemma 2 and Gemma 3 (text), as Gemma2Config and Gemma3TextConfig read a config.json.

Pure: no torch import. Gemma 2: GeGLU (gelu_pytorch_tanh); (1 + weight) RMSNorms before and after attention
and MLP; embeddings scaled by sqrt(hidden_size); scores scaled by query_pre_attn_scalar ** -0.5;
soft-capped scores and logits; sliding and full layers interleaved (layer_types, or a full layer every
sliding_window_pattern); tied embeddings. Gemma 3: Gemma 2's layers with per-head q/k norms, no soft caps by
default, and a rotary base of their own on sliding layers (rope_local_base_freq, or transformers 5's
rope_parameters per layer type), unscaled. Gemma3TextConfig reads attn_logit_softcapping but Gemma3Attention
never applies it: a gemma3_text config's score cap is inert here too (its logit cap is applied).
"""

from __future__ import annotations

from kiln.core.model.config import ModelConfig
from kiln.core.errors import BadInput
from kiln.core.model.hf_config.common import (COMMON_READ, GEMMA_MATH, INTERLEAVED, LOCAL_ROPE, QK_NORM, SLIDING, Family,
                                        aliased, flag, number, positive_int, shared_fields)
from kiln.core.model.hf_config.rope import PER_LAYER_TYPE, rope_fields

_DEFAULTS = {
    "gemma2": {"query_pre_attn_scalar": 256, "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
               "sliding_window": 4096, "pattern": 2},
    "gemma3_text": {"query_pre_attn_scalar": 256, "final_logit_softcapping": None, "attn_logit_softcapping": None,
                    "sliding_window": 4096, "pattern": 6},
}
"""What Gemma2Config and Gemma3TextConfig assume for a field config.json leaves out (a full layer every
`pattern` layers, the others sliding; head_dim 256 for both)."""
_GEMMA3_THETA, _GEMMA3_LOCAL_THETA = 1000000.0, 10000.0
"""Gemma3TextConfig's rotary bases: full layers' rope_theta, sliding layers' rope_local_base_freq."""


def _activation(raw: dict) -> str:
    """Gemma's MLP: GeGLU with gelu_pytorch_tanh (hidden_activation, or hidden_act, which must agree)."""
    value = aliased(raw, ("hidden_activation", "hidden_act"), "gelu_pytorch_tanh")
    if value != "gelu_pytorch_tanh":
        name = next(k for k in ("hidden_activation", "hidden_act") if raw.get(k) is not None)
        raise BadInput(f"config.json: {name}={value!r}: Kiln computes Gemma's MLP with gelu_pytorch_tanh only.")
    return "gelu_tanh"


def _scales(raw: dict, family: str) -> dict:
    """ModelConfig's Gemma fields: norms, embedding scale, attention scale and soft caps."""
    defaults = _DEFAULTS[family]
    if raw.get("use_bidirectional_attention"):
        raise BadInput("config.json: use_bidirectional_attention=true: Kiln computes causal decoders only.")
    out = {"norm_unit_offset": True, "sandwich_norms": True, "embed_scale": True}
    for key, field in (("query_pre_attn_scalar", "query_pre_attn_scalar"), ("attn_logit_softcapping", "attn_softcap"),
                       ("final_logit_softcapping", "final_softcap")):
        value = raw.get(key, defaults[key])
        if value is not None:
            value = number(raw, key, defaults[key])
            if not value > 0:
                raise BadInput(f"config.json: {key}={value!r} must be positive or null.")
        out[field] = value
    if family == "gemma3_text":  # transformers' Gemma3Attention passes no softcap to its attention
        out["attn_softcap"] = None
    return out


def _layers(raw: dict, family: str) -> dict:
    """Gemma's interleaving: layer_types, or else a full layer every sliding_window_pattern layers."""
    defaults = _DEFAULTS[family]
    layers = raw["num_hidden_layers"]
    types = raw.get("layer_types")
    if types is None:
        pattern = positive_int(raw, "sliding_window_pattern",
                               raw.get("_sliding_window_pattern", defaults["pattern"]))
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    if not isinstance(types, list) or not set(types) <= {"full_attention", "sliding_attention"} \
            or len(types) != layers:
        raise BadInput(f"config.json: layer_types={types!r} must list 'full_attention' / 'sliding_attention', one "
                       "entry per layer.")
    window = raw.get("sliding_window", defaults["sliding_window"])
    if window is None or "sliding_attention" not in types:
        return {}
    return {"sliding_window": window,
            "full_attention_layers": tuple(i for i, kind in enumerate(types) if kind == "full_attention")}


def _gemma3_rope(raw: dict) -> dict:
    """Gemma 3's rope: full layers' (scaled, theta 1e6 by default) and sliding layers' own base, unscaled;
    from rope_local_base_freq, or from transformers 5's rope_parameters per layer type."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params and set(params) <= PER_LAYER_TYPE:
        local = params.get("sliding_attention") or {}
        if not isinstance(local, dict) or local.get("rope_type", "default") != "default" or set(local) - {
                "rope_type", "rope_theta"}:
            raise BadInput(f"config.json: rope_parameters.sliding_attention={local!r}: Kiln computes sliding "
                           "layers' rotary embedding unscaled (rope_type default, a rope_theta).")
        full = {k: v for k, v in raw.items() if k != "rope_parameters"} | {
            "rope_parameters": params.get("full_attention") or {}}
        return {**rope_fields(full, "gemma3_text", _GEMMA3_THETA),
                "local_rope_theta": number(local, "rope_theta", _GEMMA3_LOCAL_THETA)}
    out = rope_fields({**raw, "rope_theta": raw.get("rope_theta", _GEMMA3_THETA)}, "gemma3_text", _GEMMA3_THETA)
    return {**out, "local_rope_theta": number(raw, "rope_local_base_freq", _GEMMA3_LOCAL_THETA)}


def _gemma(raw: dict, family: str) -> ModelConfig:
    activation = _activation(raw)
    bias = flag(raw, "attention_bias")
    layers, scales = _layers(raw, family), _scales(raw, family)
    return ModelConfig(**shared_fields(raw, family, head_dim=256, tie_word_embeddings=True), activation=activation,
                       qkv_bias=bias, o_bias=bias, qk_norm=family == "gemma3_text", **layers, **scales,
                       **(_gemma3_rope(raw) if family == "gemma3_text" else rope_fields(raw, family)))


def _gemma2(raw: dict) -> ModelConfig:
    return _gemma(raw, "gemma2")


def _gemma3_text(raw: dict) -> ModelConfig:
    return _gemma(raw, "gemma3_text")


def _to_hf(cfg: ModelConfig) -> dict:
    family = cfg.architecture
    if (cfg.norm_unit_offset, cfg.sandwich_norms, cfg.embed_scale, cfg.activation == "gelu_tanh",
            cfg.query_pre_attn_scalar is not None) != (True,) * 5:
        raise BadInput("Gemma's norms, embedding scale, GeGLU, attention scale and soft caps go together, in "
                       "gemma2 and gemma3_text configs only.")
    if cfg.first_sliding_layer or cfg.mlp_bias or cfg.qkv_bias != cfg.o_bias:
        raise BadInput(f"a {family} config's layers are sliding unless listed full, its attention_bias covers q, "
                       "k, v and o, and it has no mlp_bias.")
    out = {"hidden_activation": "gelu_pytorch_tanh", "attention_bias": cfg.o_bias,
           "query_pre_attn_scalar": cfg.query_pre_attn_scalar, "attn_logit_softcapping": cfg.attn_softcap,
           "final_logit_softcapping": cfg.final_softcap, "sliding_window": cfg.sliding_window,
           "layer_types": ["sliding_attention" if cfg.window_of(i) else "full_attention"
                           for i in range(cfg.num_layers)]}
    if family == "gemma3_text":
        if not cfg.qk_norm or cfg.local_rope_theta is None:
            raise BadInput("every gemma3_text config has q/k norms and a rotary base of the sliding layers' own.")
        out["rope_local_base_freq"] = cfg.local_rope_theta
    return out


_GEMMA2_READ = COMMON_READ | {"hidden_activation", "attention_bias", "query_pre_attn_scalar", "sliding_window",
                              "layer_types", "final_logit_softcapping", "attn_logit_softcapping",
                              "use_bidirectional_attention"}
GEMMA2 = Family("gemma2", _GEMMA2_READ, _gemma2, _to_hf,
                features=(GEMMA_MATH, SLIDING, INTERLEAVED))
GEMMA3_TEXT = Family("gemma3_text", _GEMMA2_READ | {"rope_local_base_freq", "sliding_window_pattern",
                                                    "_sliding_window_pattern"},
                     _gemma3_text, _to_hf, features=(GEMMA_MATH, SLIDING, INTERLEAVED, QK_NORM, LOCAL_ROPE))
