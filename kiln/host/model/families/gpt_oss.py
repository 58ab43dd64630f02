"""The gpt-oss decoder layer, as transformers' GptOssDecoderLayer computes it.

    x = x + attention(input_layernorm(x))              grouped-query attention with biases and a sink per head
    x = x + experts(post_attention_layernorm(x))       kiln.host.model.layers.oss_experts

Its RMSNorms keep their weights in float32 and scale before the cast back (GptOssRMSNorm); sliding and full
layers alternate as layer_types says (each layer's window reaches the layer as data).
"""

from __future__ import annotations

import torch

from kiln.core.model.config import ModelConfig
from kiln.host.model.layers.attention import grouped_query_attention
from kiln.host.model.layers.norms import rms_norm32
from kiln.host.model.layers.oss_experts import oss_experts
from kiln.host.model.layers.step import StepContext


def layer(cfg: ModelConfig, tp: int, p: dict[str, torch.Tensor], x: torch.Tensor, kv: torch.Tensor,
          window: torch.Tensor | None, ctx: StepContext, picks: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One gpt-oss decoder layer of one rank (see kiln.host.model.families.llama.Layer)."""
    attended, entry = grouped_query_attention(cfg, tp, p, rms_norm32(x, p["input_layernorm.weight"], cfg.rms_norm_eps),
                                              kv, window, ctx)
    x = x + attended
    h = rms_norm32(x, p["post_attention_layernorm.weight"], cfg.rms_norm_eps)
    return x + oss_experts(cfg, tp, p, h, picks), entry
