"""RMSNorm as transformers computes it, and Gemma 2's soft cap."""

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


class RMSNorm(nn.Module):
    """RMSNorm of one replicated weight (see rms_norm)."""

    def __init__(self, dim: int, eps: float, unit_offset: bool = False):
        super().__init__()
        self.eps = eps
        self.unit_offset = unit_offset
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.unit_offset)


def softcap(x: torch.Tensor, cap: float | None) -> torch.Tensor:
    """cap * tanh(x / cap) (Gemma 2's soft capping of attention scores and logits); x itself for None."""
    return x if cap is None else torch.tanh(x / cap) * cap
