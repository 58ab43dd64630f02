"""RMSNorm as transformers computes it (Llama's, Gemma's, and the float32 weights' of DeepSeek-V4 and gpt-oss), and
Gemma 2's soft cap."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool = False) -> torch.Tensor:
    """RMSNorm computed in float32 and cast back, as transformers does (it matters in bfloat16): scaled by
    `weight` after the cast (Llama), or with `unit_offset` by (1 + weight) before it (Gemma)."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if unit_offset:
        return (h * (1.0 + weight.to(torch.float32))).to(x.dtype)
    return weight * h.to(x.dtype)


def rms_norm32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of a weight kept in float32 (DeepseekV4RMSNorm, GptOssRMSNorm): normed in float32, times the
    weight, then cast to x's dtype."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(x.dtype)


class RMSNorm(nn.Module):
    """RMSNorm of one replicated weight (see rms_norm; rms_norm32 with `float32_weight`)."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False, float32_weight: bool = False):
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.float32_weight = float32_weight
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.float32_weight:
            return rms_norm32(x, self.weight, self.eps)
        return rms_norm(x, self.weight, self.eps, self.unit_offset)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap) (Gemma 2's soft capping of attention scores and logits); x itself for None."""
    return x if cap is None else torch.tanh(x / cap) * cap
