"""Mixtral, as MixtralConfig reads a config.json.

Pure: no torch import. A mixture of experts on every layer: the router's softmax, the top
num_experts_per_tok (2) of num_local_experts (8), always renormalised, each expert as wide as
intermediate_size; Mistral's attention (no biases) and sliding window.
"""

from __future__ import annotations

from kiln.core.model.config import ModelConfig
from kiln.core.errors import BadInput
from kiln.core.model.hf_config.common import COMMON_READ, EXPERTS, SLIDING, Family, aliased, shared_fields, silu
from kiln.core.model.hf_config.rope import rope_fields


def _mixtral(raw: dict) -> ModelConfig:
    return ModelConfig(**shared_fields(raw, "mixtral"), activation=silu(raw), sliding_window=raw.get("sliding_window"),
                       num_experts=aliased(raw, ("num_local_experts", "num_experts"), 8),
                       experts_per_token=raw.get("num_experts_per_tok", 2),
                       moe_intermediate_size=raw["intermediate_size"], norm_topk_prob=True,
                       moe_layers=tuple(range(raw["num_hidden_layers"])), **rope_fields(raw, "mixtral"))


def _mixtral_to_hf(cfg: ModelConfig) -> dict:
    if cfg.moe_layers != tuple(range(cfg.num_layers)) or not cfg.norm_topk_prob \
            or cfg.moe_intermediate_size != cfg.intermediate_size:
        raise BadInput("a mixtral config has experts on every layer, as wide as intermediate_size, renormalised.")
    if cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias:
        raise BadInput("a mixtral config has no attention_bias / mlp_bias.")
    return {"hidden_act": "silu", "sliding_window": cfg.sliding_window, "num_local_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.experts_per_token}


MIXTRAL = Family("mixtral", COMMON_READ | {"sliding_window", "num_local_experts", "num_experts", "num_experts_per_tok"},
                 _mixtral, _mixtral_to_hf, features=(SLIDING, EXPERTS))
