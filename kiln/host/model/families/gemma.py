"""The Gemma 2 and Gemma 3 decoder layer, as transformers' Gemma2DecoderLayer computes it.

    x = x + post_attention_layernorm(attention(input_layernorm(x)))
    x = x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))

Gemma's norms scale by (1 + weight) in float32 (ModelConfig.norm_unit_offset), the
MLP is GeGLU; the attention's scale (query_pre_attn_scalar), soft caps, q/k
norms (Gemma 3) and the sliding layers' own rotary base (Gemma 3) live in the
shared attention and in the step's context.
"""

from __future__ import annotations

import torch

from kiln.core.model.config import ModelConfig
from kiln.host.model.layers.attention import grouped_query_attention
from kiln.host.model.layers.mlp import gated_mlp
from kiln.host.model.layers.norms import rms_norm
from kiln.host.model.layers.step import StepContext


def layer(cfg: ModelConfig, tp: int, p: dict[str, torch.Tensor], x: torch.Tensor, kv: torch.Tensor,
          window: torch.Tensor | None, ctx: StepContext, picks: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x after the layer, this step's cache entry) of one rank; see kiln.host.model.families.llama.Layer (a
    dense layer: it chooses nothing)."""
    def norm(name: str, y: torch.Tensor) -> torch.Tensor:
        return rms_norm(y, p[f"{name}.weight"], cfg.rms_norm_eps, cfg.norm_unit_offset)

    attended, entry = grouped_query_attention(cfg, tp, p, norm("input_layernorm", x), kv, window, ctx)
    x = x + norm("post_attention_layernorm", attended)
    return x + norm("post_feedforward_layernorm", gated_mlp(cfg, tp, p, norm("pre_feedforward_layernorm", x))), entry
