"""gpt-oss, as GptOssConfig reads a config.json.

Pure: no torch import. Grouped-query attention with biases on q, k, v and o (attention_bias, true by default)
and a learned sink logit per query head; sliding and full layers as layer_types lists them (by default
alternating, sliding first: the window is sliding_window tokens); a mixture of experts on every layer: a
router with a bias, the top num_experts_per_tok of its logits softmaxed, each expert a clamped SwiGLU
(swiglu_limit, swiglu_alpha) over gate and up columns interleaved in one tensor, with biases. The rope is
yarn unless config.json says otherwise (GptOssConfig's default: factor 32 over 4096 tokens, untruncated,
rope_theta 150000). hidden_act is written by GptOssConfig but never read by its model: inert here too.
A field config.json leaves out takes GptOssConfig's default (gpt-oss-20b's sizes).
"""

from __future__ import annotations

from kiln.core.model.config import ModelConfig
from kiln.core.errors import BadInput
from kiln.core.model.hf_config.common import (COMMON_READ, EXPERTS, INTERLEAVED, SLIDING, Family, aliased, flag,
                                        number, positive_int, shared_fields)
from kiln.core.model.hf_config.rope import rope_fields

_DEFAULTS = {"num_hidden_layers": 36, "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
             "head_dim": 64, "num_attention_heads": 64, "num_key_value_heads": 8, "rms_norm_eps": 1e-5}
"""GptOssConfig's defaults for the sizes every family reads."""
_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
         "original_max_position_embeddings": 4096}
"""GptOssConfig's rope when config.json gives none."""
_THETA = 150000.0


def _layer_types(raw: dict, layers: int) -> tuple[int | None, tuple[int, ...]]:
    """(the window of the sliding layers or None, the full-attention layers) as layer_types lists them."""
    types = raw.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % 2 else "full_attention" for i in range(layers)]
    if not isinstance(types, list) or len(types) != layers or not set(types) <= {"full_attention",
                                                                                "sliding_attention"}:
        raise BadInput(f"config.json: layer_types={types!r} must list 'full_attention' or 'sliding_attention' for "
                       f"each of the {layers} layers.")
    window = raw.get("sliding_window", 128)
    if window is None or "sliding_attention" not in types:
        return None, ()
    window = positive_int(raw, "sliding_window", 128)
    return window, tuple(i for i, kind in enumerate(types) if kind == "full_attention")


def _gpt_oss(raw: dict) -> ModelConfig:
    raw = {**_DEFAULTS, **{k: v for k, v in raw.items() if v is not None or k not in _DEFAULTS}}
    if raw.get("rope_parameters") is None and raw.get("rope_scaling") is None:
        raw["rope_parameters"] = {**_ROPE, "rope_theta": raw.pop("rope_theta", _THETA)}
    bias = flag(raw, "attention_bias", True)
    experts = aliased(raw, ("num_local_experts", "num_experts"), 128)
    window, full = _layer_types(raw, raw["num_hidden_layers"])
    fields = shared_fields(raw, "gpt_oss", rms_norm_eps=1e-5)
    return ModelConfig(**fields, qkv_bias=bias, o_bias=bias, sliding_window=window, full_attention_layers=full,
                       num_experts=experts, experts_per_token=raw.get("num_experts_per_tok", 4),
                       moe_intermediate_size=raw["intermediate_size"], norm_topk_prob=True,
                       moe_layers=tuple(range(raw["num_hidden_layers"])), attention_sinks=True,
                       swiglu_limit=number(raw, "swiglu_limit", 7.0), swiglu_alpha=number(raw, "swiglu_alpha", 1.702),
                       **rope_fields(raw, "gpt_oss", _THETA))


def _gpt_oss_to_hf(cfg: ModelConfig) -> dict:
    if cfg.moe_layers != tuple(range(cfg.num_layers)) or cfg.moe_intermediate_size != cfg.intermediate_size:
        raise BadInput("a gpt_oss config has experts on every layer, as wide as intermediate_size.")
    if cfg.qkv_bias != cfg.o_bias or cfg.mlp_bias or cfg.first_sliding_layer:
        raise BadInput("a gpt_oss config's attention_bias covers q, k, v and o together; it has no mlp_bias, and "
                       "layer_types says which layers slide.")
    types = ["full_attention" if cfg.window_of(i) is None else "sliding_attention" for i in range(cfg.num_layers)]
    return {"attention_bias": cfg.o_bias, "sliding_window": cfg.sliding_window, "layer_types": types,
            "num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.experts_per_token,
            "swiglu_limit": cfg.swiglu_limit, "swiglu_alpha": cfg.swiglu_alpha}


GPT_OSS = Family("gpt_oss", COMMON_READ | {"sliding_window", "layer_types", "num_local_experts", "num_experts",
                                           "num_experts_per_tok", "swiglu_limit", "swiglu_alpha", "attention_bias"},
                 _gpt_oss, _gpt_oss_to_hf, features=(SLIDING, INTERLEAVED, EXPERTS), required=())
