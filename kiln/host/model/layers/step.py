"""What every layer of one step shares: rotary tables, masks and the pages to gather."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kiln.core.model import llama4_fields
from kiln.core.model.config import ModelConfig
from kiln.host.model.layers import rotary

FULL_ATTENTION = 1 << 62
"""The window of a full-attention layer among sliding ones: no distance reaches it."""
UNCHUNKED = FULL_ATTENTION - 1
"""Llama 4: the window of a layer that rotates when the model has no chunks (kiln.host.model.layers.nope)."""


@dataclass(frozen=True)
class StepContext:
    """The step's shared tensors (b sequences of t new tokens over ctx cached positions each)."""

    cos: torch.Tensor
    """[b, t, 1, rotated_dims] in the model's dtype (rotary.tables); float32 for Llama 4's rope."""
    sin: torch.Tensor
    local_cos: torch.Tensor | None
    """Sliding layers' rotary tables when they have a base of their own (Gemma 3's local_rope_theta)."""
    local_sin: torch.Tensor | None
    causal: torch.Tensor
    """[b, t, ctx + t] bool: key j is a valid, earlier-or-same position for query i."""
    distance: torch.Tensor | None
    """[b, t, ctx + t]: query position minus key position; None when no layer has a window."""
    block_table: torch.Tensor
    """[b, pages_per_seq]: the cache pages of each sequence, in order."""
    query_scale: torch.Tensor | None = None
    """[b, t, 1, 1] float32: each query's scale, 1 + beta x log(1 + floor(position / original context)) (Mistral 4's
    llama_4_scaling_beta, ModelConfig.query_scale_beta), or Llama 4's attention temperature (its layers with no
    rope); None when the model has none."""
    query_pos: torch.Tensor | None = None
    """[b, t, 1]: each query's position, where windows are chunks (Llama 4: a query at p sees the keys from
    p - p % window on); None where windows slide."""
    kv_runs: tuple[int, ...] | None = None
    """This rank's query heads per KV head where they straddle KV groups unevenly (kiln.core.model.shares.Share.
    kv_runs), else None: a static fact of the rank, not a tensor."""

    def mask(self, window: torch.Tensor | None) -> torch.Tensor:
        """[b, 1, t, ctx + t]: what a layer of `window` (0-d, or None: no window) lets each query see."""
        if window is None:
            return self.causal[:, None]
        if self.query_pos is not None:  # chunks: back to the chunk's start (a full layer's reaches position 0)
            return (self.causal & (self.distance <= self.query_pos % window))[:, None]
        return (self.causal & (self.distance < window))[:, None]

    def rotary(self, window: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) of a layer of `window`: Gemma 3's sliding layers rotate at their own base."""
        if self.local_cos is None or window is None:
            return self.cos, self.sin
        sliding = window < FULL_ATTENTION
        return torch.where(sliding, self.local_cos, self.cos), torch.where(sliding, self.local_sin, self.sin)


def step_context(cfg: ModelConfig, start_pos: torch.Tensor, num_tokens: int, page_tokens: int,
                 block_table: torch.Tensor, dtype: torch.dtype, windowed: bool,
                 seq_lens: torch.Tensor | None = None, kv_runs: tuple[int, ...] | None = None) -> StepContext:
    """The context of one step: query i of sequence b sits at position start_pos[b] + i; cached key j at
    position j (valid below start_pos[b]); new key i at start_pos[b] + i. `seq_lens` [b]: each sequence's
    length, which a longrope or dynamic rope goes by."""
    b, device = start_pos.shape[0], start_pos.device
    ctx_len = block_table.shape[1] * page_tokens
    positions = start_pos[:, None] + torch.arange(num_tokens, device=device)[None]
    llama4 = cfg.architecture == llama4_fields.ARCHITECTURE  # its complex rope turns in float32
    cos, sin = rotary.tables(cfg, positions, torch.float32 if llama4 else dtype, seq_lens)
    local_cos = local_sin = None
    if cfg.local_rope_theta is not None:  # unscaled, at the sliding layers' own base
        plain = cfg.replace(rope_theta=cfg.local_rope_theta, rope_type="default", rope_attention_factor=1.0)
        local_cos, local_sin = rotary.tables(plain, positions, dtype)
    cached = torch.arange(ctx_len, device=device)[None]
    key_pos = torch.cat((cached.expand(b, ctx_len), positions), dim=1)
    key_ok = torch.cat((cached < start_pos[:, None], torch.ones(b, num_tokens, dtype=torch.bool, device=device)),
                       dim=1)
    distance = positions[:, :, None] - key_pos[:, None, :]  # [b, t, ctx + t]
    query_scale = None
    if cfg.query_scale_beta:  # as transformers' get_llama_4_attn_scale
        grown = torch.log(1 + torch.floor(positions / cfg.rope_original_max_position))
        query_scale = (1 + cfg.query_scale_beta * grown)[:, :, None, None]
    if cfg.temperature_floor:  # Llama 4's layers with no rope: as Llama4TextAttention's attn_scales
        grown = torch.log1p(torch.floor((positions.float() + 1.0) / cfg.temperature_floor))
        query_scale = (grown * cfg.temperature_scale + 1.0)[:, :, None, None]
    return StepContext(cos=cos, sin=sin, local_cos=local_cos, local_sin=local_sin,
                       causal=key_ok[:, None, :] & (distance >= 0), distance=distance if windowed else None,
                       block_table=block_table, query_scale=query_scale, kv_runs=kv_runs,
                       query_pos=positions[:, :, None] if llama4 and windowed else None)


def gather_pages(entry: torch.Tensor, block_table: torch.Tensor) -> torch.Tensor:
    """[b, ctx, heads, width]: one cache entry [pages, page_tokens, heads, width] read through the block
    table, each sequence's pages in order."""
    b, pages = block_table.shape
    return entry[block_table].reshape(b, pages * entry.shape[1], *entry.shape[2:])
