"""Rotary position embeddings, computed as transformers computes them: frequencies, tables, rotation.

Frequencies are computed inside the graph from the config, never kept in a
buffer: Inductor inlines only tiny constants, so a buffer would become a
package constant that no checkpoint provides.
"""

from __future__ import annotations

import math

import torch

from kiln.core.model.config import ModelConfig


def rope_inv_freq(cfg: ModelConfig, device=None, seq_lens: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary inverse frequencies (float32): [rotated_dims / 2] for default, linear, llama3 or yarn; [b, 1,
    rotated_dims / 2] for longrope and dynamic, which depend on each sequence's length `seq_lens` [b]."""
    dim = cfg.rotated_dims  # a partial rotary (Phi-3) or latent attention's rope dims turn only these
    exponent = torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(torch.float32) / dim
    if cfg.length_dependent_rope:
        if seq_lens is None:
            raise ValueError(f"a {cfg.rope_type} rope depends on each sequence's length: pass seq_lens")
        return _length_dependent(cfg, exponent, seq_lens)[:, None, :]
    inv_freq = 1.0 / (cfg.rope_theta ** exponent)
    if cfg.rope_type == "linear":
        inv_freq = inv_freq / cfg.rope_factor
    elif cfg.rope_type == "llama3":
        factor, old_len = cfg.rope_factor, cfg.rope_original_max_position
        low_wavelen = old_len / cfg.rope_low_freq_factor
        high_wavelen = old_len / cfg.rope_high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
        smooth = (old_len / wavelen - cfg.rope_low_freq_factor) / (cfg.rope_high_freq_factor - cfg.rope_low_freq_factor)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        inv_freq = torch.where(medium, smoothed, scaled)
    elif cfg.rope_type == "yarn":  # transformers' _compute_yarn_parameters, op for op
        low, high = yarn_correction_range(cfg)
        pos_freqs = cfg.rope_theta ** (torch.arange(0, dim, 2, device=device).to(torch.float32) / dim)
        extrapolation, interpolation = 1.0 / pos_freqs, 1.0 / (cfg.rope_factor * pos_freqs)
        ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device=device) - low) / (high - low), 0, 1)
        keep = 1 - ramp
        inv_freq = interpolation * (1 - keep) + extrapolation * keep
    return inv_freq


def _length_dependent(cfg: ModelConfig, exponent: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """[b, rotated_dims / 2]: transformers' _compute_longrope_parameters and _compute_dynamic_ntk_parameters,
    op for op, at each sequence's length (what transformers reads as max(position_ids) + 1 of a call).

    longrope: each frequency divided by its short factor while the sequence is at most
    rope_original_max_position long, by its long factor after. dynamic: the base times
    ((factor x length / rope_max_position) - (factor - 1)) ** (dim / (dim - 2)), the length taken at least
    rope_max_position (so shorter sequences keep the base)."""
    if cfg.rope_type == "longrope":
        short, long = (_vector(factors, exponent.device) for factors in (cfg.rope_short_factor, cfg.rope_long_factor))
        base = cfg.rope_theta ** exponent
        inv_short, inv_long = 1.0 / (short * base), 1.0 / (long * base)
        return torch.where((seq_lens > cfg.rope_original_max_position)[:, None], inv_long, inv_short)
    dim = cfg.rotated_dims
    length = torch.clamp(seq_lens, min=cfg.rope_max_position)
    base = cfg.rope_theta * ((cfg.rope_factor * length / cfg.rope_max_position) - (cfg.rope_factor - 1)) ** (
        dim / (dim - 2))
    return 1.0 / (base[:, None] ** exponent)


def _vector(values: tuple[float, ...], device) -> torch.Tensor:
    """A float32 vector of `values`, computed in the graph: a `torch.tensor(values)` would become a package
    constant (Inductor inlines only up to 8 values), which no checkpoint provides."""
    index = torch.arange(len(values), device=device)
    out = torch.full((len(values),), values[0], dtype=torch.float32, device=device)
    for i, value in enumerate(values[1:], start=1):
        out = torch.where(index == i, value, out)
    return out


def yarn_correction_range(cfg: ModelConfig) -> tuple[float, float]:
    """yarn's ramp between the dims that keep their frequency and the interpolated ones, as transformers
    bounds it (its beta_fast and beta_slow rotations over the original context; whole dims when truncated)."""
    dim, base, old_len = cfg.rotated_dims, cfg.rope_theta, cfg.rope_original_max_position

    def dim_of(rotations: float) -> float:
        return (dim * math.log(old_len / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = dim_of(cfg.rope_beta_fast), dim_of(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    return low, (high + 0.001 if low == high else high)


def tables(cfg: ModelConfig, positions: torch.Tensor, dtype: torch.dtype,
           seq_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [b, t, 1, rotated_dims] of `positions` [b, t], in `dtype`: each frequency twice (the two
    halves), times the attention factor (yarn's, longrope's) before the cast, as transformers does.
    `seq_lens` [b]: each sequence's length, for the rope types that depend on it."""
    freqs = positions[..., None].to(torch.float32) * rope_inv_freq(cfg, positions.device, seq_lens)
    emb = torch.cat((freqs, freqs), dim=-1)[:, :, None, :]
    cos, sin = emb.cos(), emb.sin()
    if cfg.rope_attention_factor != 1.0:
        cos, sin = cos * cfg.rope_attention_factor, sin * cfg.rope_attention_factor
    return cos.to(dtype), sin.to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of x's leading cos.shape[-1] dims, by halves; the rest pass through (a partial
    rotary)."""
    dim = cos.shape[-1]
    if dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    turned, kept = x[..., :dim], x[..., dim:]
    return torch.cat((turned * cos + _rotate_half(turned) * sin, kept), dim=-1)


def rotate_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary embedding of adjacent pairs (x0, x1), (x2, x3), ... each by one frequency (DeepSeek's
    rope_interleave), laid out as transformers lays it out: the pairs' first members, then their second."""
    cos, sin = cos[..., :cos.shape[-1] // 2], sin[..., :sin.shape[-1] // 2]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
