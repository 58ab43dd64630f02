"""DeepSeek-V4's attention of one rank, as transformers' DeepseekV4Attention computes it over a prompt fed
from position 0 in one call (no cache: kiln.core.v4_fields.export_refusal says what is missing for steps).

Every layer: a low-rank query (wq_a, its weighted RMSNorm q_norm, wq_b, then an unweighted RMSNorm per
head) and one shared key=value head (wkv, its RMSNorm), each rotated on its trailing qk_rope_head_dim dims
in interleaved pairs, attend over a sliding window with a learned sink logit per head (a softmax column
that is then dropped); the output's rotated dims are turned back by the query's position, and the heads
are projected per group (wo_a, o_groups groups) then together (wo_b, row-parallel). Sliding layers rotate
at the main rope; compressed layers at the compress rope (kiln.core.v4_fields) and also attend to
compressed entries:
- a compressor turns each window of `rate` tokens into one entry: a softmax over the window (per
  channel, gate + position bias `ape`) weighs its projected tokens, then an RMSNorm and the rotation at
  the window's first position. A CSA compressor's windows overlap: each entry also weighs the previous
  window's tokens through their first projection half (its own window's go through the second half);
- HCA: a query sees every entry whose window ends at or before it;
- CSA: a lightning indexer (its own overlapping compressor at index_head_dim, index_n_heads query
  heads from the low-rank query) scores the entries a query may see, sum_h w_h relu(q_h . k) scaled,
  and the query attends to the best index_topk of them only.
Heads, sinks and output groups are split across ranks; the key=value head, compressors and indexer are
computed whole on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.core.config import ModelConfig
from kiln.core.v4_fields import CSA, SLIDING
from kiln.host.model.collectives import reduce
from kiln.host.model.hyper_connections import unweighted_rms_norm
from kiln.host.model.rotary import rope_inv_freq


def rms_norm32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """DeepseekV4RMSNorm: normed in float32, times the (float32) weight, then cast to x's dtype."""
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return (weight * h).to(x.dtype)


def main_rope(cfg: ModelConfig) -> ModelConfig:
    """The config whose rope is the sliding layers' own: plain, at main_rope_theta."""
    return cfg.replace(rope_theta=cfg.v4.main_rope_theta, rope_type="default", rope_attention_factor=1.0)


def pair_tables(cfg: ModelConfig, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) [..., qk_rope_head_dim / 2] of `positions`, one entry per rotated pair, in `dtype`."""
    freqs = positions[..., None].to(torch.float32) * rope_inv_freq(cfg, positions.device)
    factor = cfg.rope_attention_factor
    return (freqs.cos() * factor).to(dtype), (freqs.sin() * factor).to(dtype)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x's trailing 2 x cos.shape[-1] dims rotated in adjacent pairs, in place (x0, x1 stay neighbours),
    in float32 and cast back; `cos`/`sin` broadcast against x's leading dims."""
    dim = 2 * cos.shape[-1]
    kept, turned = x[..., :-dim], x[..., -dim:]
    cos, sin = cos.repeat_interleave(2, dim=-1), sin.repeat_interleave(2, dim=-1)
    half = torch.stack((-turned[..., 1::2], turned[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat((kept, (turned.float() * cos + half.float() * sin).to(x.dtype)), dim=-1)


def compress(cfg: ModelConfig, p: dict[str, torch.Tensor], prefix: str, x: torch.Tensor, rate: int,
             overlap: bool) -> torch.Tensor:
    """[b, windows, width]: one entry per complete window of `rate` tokens of x [b, t, hidden] (the tokens
    after the last complete window make none yet), rotated at the window's first position."""
    b, t, _ = x.shape
    windows = t // rate
    width = p[f"{prefix}.norm.weight"].shape[0]
    kv = F.linear(x[:, :windows * rate], p[f"{prefix}.wkv.weight"]).view(b, windows, rate, -1)
    gate = F.linear(x[:, :windows * rate], p[f"{prefix}.wgate.weight"]).view(b, windows, rate, -1) + p[f"{prefix}.ape"]
    if overlap:  # [previous window's first halves | this window's second halves], 2 x rate slots
        none = torch.zeros_like(kv[:, :1, :, :width])
        kv = torch.cat((torch.cat((none, kv[:, :-1, :, :width]), dim=1), kv[..., width:]), dim=2)
        gate = torch.cat((torch.cat((torch.full_like(gate[:, :1, :, :width], float("-inf")),
                                     gate[:, :-1, :, :width]), dim=1), gate[..., width:]), dim=2)
    weights = gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)
    entries = rms_norm32((kv * weights).sum(dim=2), p[f"{prefix}.norm.weight"], cfg.rms_norm_eps)
    first = torch.arange(windows, device=x.device) * rate
    cos, sin = pair_tables(cfg, first, x.dtype)
    return rotate_pairs(entries, cos, sin)


def indexer_picks(cfg: ModelConfig, p: dict[str, torch.Tensor], x: torch.Tensor, q_low: torch.Tensor,
                  positions: torch.Tensor, ready: torch.Tensor) -> torch.Tensor:
    """[b, t, entries] bool: the compressed entries each query attends to, the index_topk best by the
    lightning indexer's score among those `ready` [b, t, entries] for it (fewer when fewer are ready)."""
    v4, (b, t, _) = cfg.v4, x.shape
    keys = compress(cfg, p, "attn.indexer.compressor", x, v4.csa_rate, overlap=True)  # [b, n, index_head_dim]
    n = keys.shape[1]
    q = F.linear(q_low, p["attn.indexer.wq_b.weight"]).view(b, t, -1, v4.index_head_dim)
    cos, sin = pair_tables(cfg, positions, x.dtype)
    q = rotate_pairs(q, cos[:, :, None], sin[:, :, None])
    scores = F.relu(torch.einsum("bthd,bnd->bthn", q.float(), keys.float())) * v4.index_head_dim ** -0.5
    heads = F.linear(x, p["attn.indexer.weights_proj.weight"]).float() * v4.index_n_heads ** -0.5
    score = (scores * heads[..., None]).sum(dim=2).masked_fill(~ready, float("-inf"))  # [b, t, n]
    best = score.topk(min(v4.index_topk, n), dim=-1).indices
    best = torch.where(ready.gather(-1, best), best, n)  # a pick among entries not ready: none
    return torch.zeros(b, t, n + 1, dtype=torch.bool, device=x.device).scatter(-1, best, True)[..., :n]


def attention(cfg: ModelConfig, tp: int, kind: str, p: dict[str, torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The attention output [b, t, hidden] summed over the ranks, of layer kind `kind` over x [b, t, hidden],
    the prompt's tokens at positions 0..t-1."""
    b, t, _ = x.shape
    d, eps, v4 = cfg.head_dim, cfg.rms_norm_eps, cfg.v4
    positions = torch.arange(t, device=x.device)[None].expand(b, t)
    cos, sin = pair_tables(main_rope(cfg) if kind == SLIDING else cfg, positions, x.dtype)  # [b, t, rope / 2]
    q_low = rms_norm32(F.linear(x, p["attn.wq_a.weight"]), p["attn.q_norm.weight"], eps)
    q = unweighted_rms_norm(F.linear(q_low, p["attn.wq_b.weight"]).view(b, t, -1, d), eps)
    q = rotate_pairs(q, cos[:, :, None], sin[:, :, None]).transpose(1, 2)  # [b, heads, t, d]
    kv = rotate_pairs(rms_norm32(F.linear(x, p["attn.wkv.weight"]), p["attn.norm.weight"], eps), cos, sin)
    distance = positions[:, :, None] - positions[:, None, :]
    visible = (distance >= 0) & (distance < cfg.sliding_window)  # [b, t, t]
    if kind != SLIDING:
        rate = v4.rate_of(kind)
        entries = compress(cfg, p, "attn.compressor", x, rate, overlap=kind == CSA)
        ready = torch.arange(entries.shape[1], device=x.device) < ((positions + 1) // rate)[..., None]
        if kind == CSA:
            ready = indexer_picks(cfg, p, x, q_low, positions, ready)
        kv, visible = torch.cat((kv, entries), dim=1), torch.cat((visible, ready), dim=-1)
    scores = torch.matmul(q, kv[:, None].transpose(-1, -2)) * d ** -0.5  # [b, heads, t, keys]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    sinks = p["attn.attn_sink"].reshape(1, -1, 1, 1).expand(b, -1, t, 1)
    logits = torch.cat((scores, sinks.to(scores.dtype)), dim=-1)
    probs = torch.softmax(logits - logits.max(dim=-1, keepdim=True).values, dim=-1)[..., :-1]
    out = torch.matmul(probs.to(kv.dtype), kv[:, None]).transpose(1, 2)  # [b, t, heads, d]
    out = rotate_pairs(out, cos[:, :, None], -sin[:, :, None])
    groups = p["attn.wo_a.weight"].shape[0] // v4.o_lora_rank  # this rank's output groups
    w = p["attn.wo_a.weight"].view(groups, v4.o_lora_rank, -1)
    grouped = torch.einsum("btgi,goi->btgo", out.reshape(b, t, groups, -1), w).flatten(2)
    return reduce(F.linear(grouped, p["attn.wo_b.weight"]), tp)
