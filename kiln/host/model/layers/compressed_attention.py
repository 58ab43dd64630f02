"""DeepSeek-V4's attention of one rank over a step of new tokens and its cache, as transformers'
DeepseekV4Attention computes it with its DeepseekV4HCACache / DeepseekV4CSACache.

Every layer: a low-rank query (wq_a, its weighted RMSNorm q_norm, wq_b, then an unweighted RMSNorm per
head) and one shared key=value head (wkv, its RMSNorm), each rotated on its trailing qk_rope_head_dim dims
in interleaved pairs, attend over a sliding window with a learned sink logit per head (a softmax column
that is then dropped); the output's rotated dims are turned back by the query's position, and the heads
are projected per group (wo_a, o_groups groups) then together (wo_b, row-parallel). Sliding layers rotate
at the main rope; compressed layers at the compress rope (kiln.core.model.v4_fields) and also attend to
compressed entries (kiln.host.model.layers.compressor: one per window of rate tokens):
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

from kiln.core.model.config import ModelConfig
from kiln.core.model.v4_fields import CSA, SLIDING
from kiln.host.model.layers import lightning_indexer
from kiln.host.model.layers.collectives import reduce
from kiln.host.model.layers.compressor import compress, pair_tables, ring_read, ring_write, rotate_pairs
from kiln.host.model.layers.norms import rms_norm32
from kiln.host.model.layers.hyper_connections import unweighted_rms_norm


def main_rope(cfg: ModelConfig) -> ModelConfig:
    """The config whose rope is the sliding layers' own: plain, at main_rope_theta."""
    return cfg.replace(rope_theta=cfg.v4.main_rope_theta, rope_type="default", rope_attention_factor=1.0)


def indexer_picks(cfg: ModelConfig, p: dict[str, torch.Tensor], x: torch.Tensor, q_low: torch.Tensor,
                  positions: torch.Tensor, keys: torch.Tensor, ready: torch.Tensor,
                  picks: dict | None = None) -> torch.Tensor:
    """[b, t, entries] bool: the compressed entries each query attends to, the index_topk best by the
    lightning indexer's score over its keys [b, entries, index_head_dim] among those `ready` [b, t, entries]
    for it (fewer when fewer are ready). The picks [b, t, min(index_topk, entries)] go into `picks`
    (kiln.host.model.layers.choices), `entries` where none: fewer were ready."""
    v4, (b, t, _) = cfg.v4, x.shape
    q = F.linear(q_low, p["attn.indexer.wq_b.weight"]).view(b, t, -1, v4.index_head_dim)
    cos, sin = pair_tables(cfg, positions, x.dtype)
    q = rotate_pairs(q, cos[:, :, None], sin[:, :, None])
    heads = F.linear(x, p["attn.indexer.weights_proj.weight"]).float() * v4.index_n_heads ** -0.5
    return lightning_indexer.best(lightning_indexer.scores(q, keys, heads), ready, v4.index_topk, picks)


def attention(cfg: ModelConfig, tp: int, kind: str, p: dict[str, torch.Tensor], x: torch.Tensor, start: torch.Tensor,
              state: dict[str, torch.Tensor], picks: dict | None = None) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(the attention output [b, t, hidden] summed over the ranks, the layer's state after the step) of layer
    kind `kind` over x [b, t, hidden], the tokens at positions start[b]..start[b]+t-1, and the layer's `state`
    (kiln.core.model.v4_fields.layer_state, each with a leading batch dimension) of the positions before. A
    CSA layer's indexer picks go into `picks`."""
    b, t, _ = x.shape
    d, eps, v4, window = cfg.head_dim, cfg.rms_norm_eps, cfg.v4, cfg.sliding_window
    positions = start[:, None] + torch.arange(t, device=x.device)  # [b, t]
    cos, sin = pair_tables(main_rope(cfg) if kind == SLIDING else cfg, positions, x.dtype)  # [b, t, rope / 2]
    q_low = rms_norm32(F.linear(x, p["attn.wq_a.weight"]), p["attn.q_norm.weight"], eps)
    q = unweighted_rms_norm(F.linear(q_low, p["attn.wq_b.weight"]).view(b, t, -1, d), eps)
    q = rotate_pairs(q, cos[:, :, None], sin[:, :, None]).transpose(1, 2)  # [b, heads, t, d]
    kv = rotate_pairs(rms_norm32(F.linear(x, p["attn.wkv.weight"]), p["attn.norm.weight"], eps), cos, sin)
    kv = torch.cat((ring_read(state["window"], start), kv), dim=1)  # positions start - window ..
    new = {"window": ring_write(kv, start + t, window)}
    distance = positions[:, :, None] - (torch.arange(window + t, device=x.device) + start[:, None] - window)[:, None]
    visible = (distance >= 0) & (distance < window) & (distance <= positions[:, :, None])  # [b, t, window + t]
    if kind != SLIDING:
        rate = v4.rate_of(kind)
        new.update(compress(cfg, p, "attn.compressor", x, start, rate, state))
        entries = new["entries"]
        ready = torch.arange(entries.shape[1], device=x.device) < ((positions + 1) // rate)[..., None]
        if kind == CSA:
            new.update(compress(cfg, p, "attn.indexer.compressor", x, start, rate, state, "index_"))
            ready = indexer_picks(cfg, p, x, q_low, positions, new["index_entries"], ready, picks)
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
    return reduce(F.linear(grouped, p["attn.wo_b.weight"]), tp), new
