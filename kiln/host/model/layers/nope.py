"""Llama 4's positions in attention: the rotating layers' complex rope and weightless q/k norm, the other
layers' attention temperature, chosen per layer by its window (kiln.core.model.llama4_fields).

Llama4TextAttention turns adjacent pairs (x0, x1), (x2, x3), ... of each head as complex numbers, in float32,
by the position's angles (its `freqs_cis`), then casts back; use_qk_norm RMS-normalises the turned q and k
over head_dim in float32, without a weight, and casts back. A layer with no rope leaves q and k as projected
and multiplies each query by its temperature (StepContext.query_scale, float32) before the cast back. A layer's
kind is data: its window is FULL_ATTENTION exactly when it has no rope, so one scanned body computes both and
keeps the layer's own (`torch.where` on a 0-d flag).
"""

from __future__ import annotations

import torch

from kiln.core.model.config import ModelConfig
from kiln.host.model.layers.step import FULL_ATTENTION, StepContext


def positions(cfg: ModelConfig, q: torch.Tensor, k: torch.Tensor, window: torch.Tensor | None,
              ctx: StepContext) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, k) of a Llama 4 layer [b, t, heads, head_dim] after its positions: turned (and normed), or, on a layer
    with no rope (`window` FULL_ATTENTION), q scaled by its temperature. `window` None: every layer turns."""
    turned_q, turned_k = (_turn(x, ctx.cos, ctx.sin) for x in (q, k))
    if cfg.qk_l2_norm:
        turned_q, turned_k = _l2_norm(turned_q, cfg.rms_norm_eps), _l2_norm(turned_k, cfg.rms_norm_eps)
    if window is None:
        return turned_q, turned_k
    plain_q = q if ctx.query_scale is None else (q * ctx.query_scale).to(q.dtype)
    rope = window < FULL_ATTENTION
    return torch.where(rope, turned_q, plain_q), torch.where(rope, turned_k, k)


def _turn(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [b, t, heads, hd] with each adjacent pair turned as a complex number by its frequency's angle, in
    float32 (cos, sin [b, t, 1, hd]: each frequency twice, kiln.host.model.layers.rotary.tables), cast back."""
    half = cos.shape[-1] // 2
    c, s = cos[..., :half], sin[..., :half]
    real, imag = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.stack((real * c - imag * s, real * s + imag * c), dim=-1).flatten(-2).to(x.dtype)


def _l2_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama4TextL2Norm: x over its last dimension divided by its root mean square, in float32, cast back."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
