"""Llama (2, 3, 3.1, 3.2) and Mistral, as LlamaConfig and MistralConfig read a config.json.

Pure: no torch import. Llama: `attention_bias` on q, k, v and o together, `mlp_bias`, tied embeddings, no
sliding window. Mistral: no biases, `sliding_window` (null, or a window on every layer).
"""

from __future__ import annotations

from kiln.core.model.config import ModelConfig
from kiln.core.errors import BadInput
from kiln.core.model.hf_config.common import COMMON_READ, SLIDING, Family, flag, shared_fields, silu
from kiln.core.model.hf_config.rope import rope_fields


def _llama(raw: dict) -> ModelConfig:
    bias = flag(raw, "attention_bias")
    return ModelConfig(**shared_fields(raw, "llama"), activation=silu(raw), qkv_bias=bias, o_bias=bias,
                       mlp_bias=flag(raw, "mlp_bias"), **rope_fields(raw, "llama"))


def _llama_to_hf(cfg: ModelConfig) -> dict:
    if cfg.qkv_bias != cfg.o_bias:
        raise BadInput("a llama config's attention_bias covers q, k, v and o together.")
    return {"hidden_act": "silu", "attention_bias": cfg.o_bias, "mlp_bias": cfg.mlp_bias}


LLAMA = Family("llama", COMMON_READ | {"attention_bias", "mlp_bias"}, _llama, _llama_to_hf)


def _mistral(raw: dict) -> ModelConfig:
    return ModelConfig(**shared_fields(raw, "mistral"), activation=silu(raw), sliding_window=raw.get("sliding_window"),
                       **rope_fields(raw, "mistral"))


def _mistral_to_hf(cfg: ModelConfig) -> dict:
    if cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias:
        raise BadInput("a mistral config has no attention_bias / mlp_bias.")
    return {"hidden_act": "silu", "sliding_window": cfg.sliding_window}


MISTRAL = Family("mistral", COMMON_READ | {"sliding_window"}, _mistral, _mistral_to_hf, features=(SLIDING,))
