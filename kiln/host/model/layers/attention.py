"""Grouped-query attention of one rank over the paged KV cache (Llama, Mistral, Qwen, Gemma, Phi-3).

A rank holds its share of the query heads and the key/value heads they use (kiln.core.model.shares: whole
KV groups, or, with fewer KV heads than ranks, a run of query heads per KV head it holds): q, k and v are
column-parallel (their rows split over the ranks), o is row-parallel and summed over the ranks. The layer's
cache entry is [2, pages, page_tokens, the rank's KV heads, head_dim]: the keys (rotated) and the values of
every cached token.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from kiln.core.model import llama4_fields
from kiln.core.model.config import ModelConfig
from kiln.host.model.layers import nope
from kiln.host.model.layers.collectives import linear_then_reduce, reduce
from kiln.host.model.layers.norms import rms_norm, softcap
from kiln.host.model.layers.paged_attention import IN_PLACE_TOKENS, attend_in_place
from kiln.host.model.layers.rotary import rotate
from kiln.host.model.layers.step import StepContext, gather_pages


def attend(cfg: ModelConfig, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
           mask: torch.Tensor, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention [b, heads, t, v_width] of q over keys/values where `mask` [b, 1, t, keys] allows.

    Scaled by query_pre_attn_scalar ** -0.5 when the config gives one (Gemma), else head_dim ** -0.5 times
    attn_scale_multiplier (DeepSeek's yarn mscale). Soft-capped scores (Gemma 2) and sinks (gpt-oss: `sinks`
    [heads], a logit per head that joins each row's softmax and attends to nothing) are computed as
    transformers' eager attention does: scores, cap, mask, the sink column, a float32 softmax cast back, the
    sink's column dropped, then the values; otherwise torch's fused attention."""
    scale = attention_scale(cfg)
    if cfg.attn_softcap is None and sinks is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    scores = softcap(torch.matmul(q, keys.transpose(2, 3)) * scale, cfg.attn_softcap)
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        b, heads, t, _ = scores.shape
        scores = torch.cat((scores, sinks.to(scores.dtype).reshape(1, heads, 1, 1).expand(b, heads, t, 1)), dim=-1)
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs if sinks is None else probs[..., :-1], values)


def attention_scale(cfg: ModelConfig) -> float:
    """query_pre_attn_scalar ** -0.5 when the config gives one (Gemma), else head_dim ** -0.5 times
    attn_scale_multiplier (DeepSeek's yarn mscale)."""
    if cfg.query_pre_attn_scalar is not None:
        return cfg.query_pre_attn_scalar ** -0.5
    return cfg.head_dim ** -0.5 * cfg.attn_scale_multiplier


def grouped_query_attention(cfg: ModelConfig, tp: int, p: dict[str, torch.Tensor], h: torch.Tensor,
                            kv: torch.Tensor, window: torch.Tensor | None, ctx: StepContext,
                            picks: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the attention's output [b, t, hidden] summed over the ranks, this step's cache entry
    [2, b, t, the rank's KV heads, head_dim]: its rotated keys and its values). Its head counts are its
    weights' (kiln.core.model.shares); query heads that straddle KV groups unevenly (ctx.kv_runs) attend in
    runs, one per KV head.

    `p` holds the layer's tensors by checkpoint suffix (`self_attn.q_proj.weight`, ...), `h` the normed
    input, `kv` the layer's cache, `window` a 0-d window (tokens a query may look back, itself included)
    or None. It makes no choices (`picks`, latent attention's, is left alone).
    """
    b, t, _ = h.shape
    hd = cfg.head_dim
    q = F.linear(h, p["self_attn.q_proj.weight"], p.get("self_attn.q_proj.bias"))
    k = F.linear(h, p["self_attn.k_proj.weight"], p.get("self_attn.k_proj.bias"))
    v = F.linear(h, p["self_attn.v_proj.weight"], p.get("self_attn.v_proj.bias"))
    if cfg.qk_norm_whole:  # MiniMax-M2: q and k each normalised over all their heads, before the split
        q, k = whole_qk_norm(cfg, tp, p, q, k)
    q, k, v = q.view(b, t, q.shape[-1] // hd, hd), k.view(b, t, k.shape[-1] // hd, hd), v.view(b, t, -1, hd)
    if cfg.qk_norm and not cfg.qk_norm_whole:  # Qwen3, Gemma 3: every head over head_dim, before the rotary
        q = rms_norm(q, p["self_attn.q_norm.weight"], cfg.rms_norm_eps, cfg.norm_unit_offset)
        k = rms_norm(k, p["self_attn.k_norm.weight"], cfg.rms_norm_eps, cfg.norm_unit_offset)
    if cfg.architecture == llama4_fields.ARCHITECTURE:  # Llama 4: complex rope and l2 norm, or a temperature
        q, k = nope.positions(cfg, q, k, window, ctx)
    else:
        cos, sin = ctx.rotary(window)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    sinks = p.get("self_attn.sinks")  # gpt-oss: one per query head of the rank
    if ctx.kv_runs is None:
        out = _grouped(cfg, q, k, v, kv, window, ctx, sinks)
    else:  # each KV head with its run of query heads, in order
        starts = [sum(ctx.kv_runs[:i]) for i in range(len(ctx.kv_runs))]
        out = torch.cat([_grouped(cfg, q[:, :, a:a + n], k[:, :, i:i + 1], v[:, :, i:i + 1], kv[:, :, :, i:i + 1],
                                  window, ctx, None if sinks is None else sinks[a:a + n])
                         for i, (a, n) in enumerate(zip(starts, ctx.kv_runs))], dim=2)
    attended = linear_then_reduce(out.reshape(b, t, -1), p["self_attn.o_proj.weight"],
                                  p.get("self_attn.o_proj.bias"), tp)
    return attended, torch.stack((k, v))


def whole_qk_norm(cfg: ModelConfig, tp: int, p: dict[str, torch.Tensor], q: torch.Tensor,
                  k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MiniMax-M2's q_norm and k_norm (MiniMaxM2RMSNorm over the whole projection, float32, the weight applied
    after the cast back) of a rank's columns q [b, t, its heads x hd] and k: the mean of squares is over every
    rank's columns, so each rank's sums of squares are summed over the ranks (one collective for both)."""
    qf, kf = q.to(torch.float32), k.to(torch.float32)
    sums = reduce(torch.stack((qf.pow(2).sum(-1), kf.pow(2).sum(-1)), dim=-1), tp)
    widths = (cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim)
    normed = [x * torch.rsqrt(sums[..., i:i + 1] / width + cfg.rms_norm_eps)
              for i, (x, width) in enumerate(zip((qf, kf), widths))]
    return (p["self_attn.q_norm.weight"] * normed[0].to(q.dtype),
            p["self_attn.k_norm.weight"] * normed[1].to(k.dtype))


def _grouped(cfg: ModelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
             window: torch.Tensor | None, ctx: StepContext, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """[b, t, heads, head_dim]: query heads q [b, t, heads, hd] in equal groups, one per KV head of k and v
    [b, t, kv_heads, hd] and of the cache `kv` [2, pages, page_tokens, kv_heads, hd]; `sinks` [heads] or None."""
    # Decode: the cached pages read where they lie. Decided when traced; over a range of token counts only when
    # every count of the range qualifies (statically_known_true adds no guard that would narrow the range).
    if statically_known_true(q.shape[1] <= IN_PLACE_TOKENS):
        return attend_in_place(cfg, q, k, v, kv, ctx.block_table, ctx.mask(window), attention_scale(cfg), sinks)
    group = q.shape[2] // k.shape[2]
    keys = torch.cat((gather_pages(kv[0], ctx.block_table), k), dim=1).repeat_interleave(group, dim=2)
    values = torch.cat((gather_pages(kv[1], ctx.block_table), v), dim=1).repeat_interleave(group, dim=2)
    return attend(cfg, q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                  ctx.mask(window), sinks).transpose(1, 2)
