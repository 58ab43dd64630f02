"""Multi-head latent attention of one rank (DeepSeek-V3), as transformers' DeepseekV3Attention computes it.

Every token is compressed to one latent of kv_lora_rank (kv_a_proj_with_mqa,
then kv_a_layernorm) plus one rotary key of qk_rope_head_dim that all heads
share; each head's keys (their qk_nope_head_dim part) and values are projected
back up from the latent (kv_b_proj). So the layer's cache entry is what latent
attention exists for: [1, pages, page_tokens, 1, kv_lora_rank + qk_rope_head_dim],
the latent and the rotated key of every cached token, not per-head keys and
values. The latent is the same on every rank (its projection is replicated);
the up-projections are split by heads (q_b_proj or q_proj, kv_b_proj:
column-parallel), o_proj is row-parallel and summed over the ranks.

A step computes the attention one of two ways, the same math in another order,
whichever multiplies less at its shapes (fixed when the graph is traced,
`absorbs`; over a range of shapes, absorbed only where it multiplies less at
every shape of the range):
- expanded, as transformers does: every cached latent projected up to each
  head's keys and values (kv_b_proj), then attention over them: its cost
  grows with the context times kv_lora_rank x heads x (nope + v_head_dim);
- absorbed: kv_b_proj's key half folded into each head's query (q_nope @ W_uk,
  a query over the latent) and its value half applied after the attention
  (attention over the latents themselves, then @ W_uv), so the cached latents
  are read as they are. For decode at a long context this multiplies a small
  fraction of the expanded form's work (at DeepSeek-V3's sizes and 4096
  tokens of context, about 1/100); for a long prefill the expanded form is
  cheaper.

DeepSeek sparse attention (DeepSeek-V3.2, GLM-5: kiln.core.model.dsa_fields) adds a lightning indexer
(kiln.host.model.layers.lightning_indexer): its key of each token is cached after the latent and the rotary
key, and each query attends only to the index_topk tokens it scores best, a mask on either form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from kiln.core.model.config import ModelConfig
from kiln.host.model.layers.attention import attend
from kiln.host.model.layers import lightning_indexer
from kiln.host.model.layers.collectives import linear_then_reduce
from kiln.host.model.layers.norms import rms_norm
from kiln.host.model.layers.rotary import rotate, rotate_interleaved
from kiln.host.model.layers.step import StepContext, gather_pages

LATENT_NORM_EPS = 1e-6
"""q_a_layernorm's and kv_a_layernorm's epsilon: DeepseekV3RMSNorm's default, whatever rms_norm_eps says."""
INDEX_NORM_EPS = 1e-6
"""DeepSeek sparse attention's indexer k_norm (a LayerNorm) epsilon, as DeepseekV32Indexer sets it."""


def latent_attention(cfg: ModelConfig, tp: int, p: dict[str, torch.Tensor], h: torch.Tensor, kv: torch.Tensor,
                     window: torch.Tensor | None, ctx: StepContext,
                     picks: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(the attention's output [b, t, hidden] summed over the ranks, this step's cache entry
    [1, b, t, 1, kv_lora_rank + qk_rope_head_dim (+ index_head_dim)]: each new token's normed latent and rotated
    key (and, with DeepSeek sparse attention, its indexer key; the indexer's picks go into `picks`))."""
    b, t, _ = h.shape
    nope, rope = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim
    if cfg.q_lora_rank:
        q = F.linear(h, p["self_attn.q_a_proj.weight"], p.get("self_attn.q_a_proj.bias"))
        q_low = rms_norm(q, p["self_attn.q_a_layernorm.weight"], LATENT_NORM_EPS)
        q = F.linear(q_low, p["self_attn.q_b_proj.weight"])
    else:
        q = F.linear(h, p["self_attn.q_proj.weight"])
    heads = q.shape[-1] // cfg.head_dim  # the rank's share (kiln.core.model.shares), from its weights
    q_nope, q_rot = q.view(b, t, heads, cfg.head_dim).split((nope, rope), dim=-1)
    compressed = F.linear(h, p["self_attn.kv_a_proj_with_mqa.weight"], p.get("self_attn.kv_a_proj_with_mqa.bias"))
    latent, k_rot = compressed.split((cfg.kv_lora_rank, rope), dim=-1)
    latent = rms_norm(latent, p["self_attn.kv_a_layernorm.weight"], LATENT_NORM_EPS)
    turn = rotate_interleaved if cfg.rope_interleave else rotate
    cos, sin = ctx.rotary(window)
    q_rot, k_rot = turn(q_rot, cos, sin), turn(k_rot[:, :, None, :], cos, sin)
    if ctx.query_scale is not None:  # Mistral 4: queries grow with their position
        scale = ctx.query_scale.to(q_rot.dtype)
        q_nope, q_rot = q_nope * scale, q_rot * scale
    entry = torch.cat((latent[:, :, None, :], k_rot), dim=-1)  # [b, t, 1, latent + rope]
    if cfg.dsa is not None:  # the indexer's key of each new token, cached after them
        entry = torch.cat((entry, _index_key(cfg, p, h, cos, sin)[:, :, None, :]), dim=-1)
    every = torch.cat((gather_pages(kv[0], ctx.block_table), entry), dim=1)[:, :, 0]  # [b, ctx + t, entry]
    n, r, v = every.shape[1], cfg.kv_lora_rank, cfg.v_head_dim
    up = p["self_attn.kv_b_proj.weight"]  # [heads * (nope + v), r]
    mask = ctx.mask(window)
    if cfg.dsa is not None:  # each query attends to the index_topk tokens the indexer ranks best
        index_q = _index_query(cfg, p, q_low, cos, sin)
        weights = F.linear(h, p["self_attn.indexer.weights_proj.weight"]).float() * cfg.dsa.index_heads ** -0.5
        score = lightning_indexer.scores(index_q, every[..., r + rope:], weights)
        mask = mask & lightning_indexer.best(score, mask[:, 0], cfg.dsa.index_topk, picks, "topk")[:, None]
        every = every[..., :r + rope]
    if absorbs(cfg, heads, t, n):
        w_k, w_v = up.view(heads, nope + v, r).split((nope, v), dim=1)  # [heads, nope, r], [heads, v, r]
        query = torch.cat((torch.einsum("bthn,hnr->bthr", q_nope, w_k), q_rot), dim=-1)  # [b, t, heads, r + rope]
        keys = every[:, None].expand(b, heads, n, r + rope)
        over_latents = attend(cfg, query.transpose(1, 2), keys, keys[..., :r], mask)  # [b, heads, t, r]
        out = torch.einsum("bhtr,hvr->bthv", over_latents, w_v)
    else:
        k_nope, values = F.linear(every[..., :r], up).view(b, n, heads, nope + v).split((nope, v), dim=-1)
        keys = torch.cat((k_nope, every[:, :, None, r:].expand(b, n, heads, rope)), dim=-1)
        query = torch.cat((q_nope, q_rot), dim=-1)
        out = attend(cfg, query.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), mask).transpose(1, 2)
    attended = linear_then_reduce(out.reshape(b, t, heads * v), p["self_attn.o_proj.weight"],
                                  p.get("self_attn.o_proj.bias"), tp)
    return attended, entry[None]


def absorbs(cfg: ModelConfig, heads: int, tokens: int, keys: int) -> bool:
    """Whether a step of `tokens` new tokens per sequence attending to `keys` positions (context and new)
    multiplies less absorbed than expanded, for `heads` heads (multiply-adds per sequence and layer)."""
    r, nope, rope, v = cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
    expanded = keys * r * heads * (nope + v) + tokens * keys * heads * (nope + rope + v)
    absorbed = tokens * heads * r * (nope + v) + tokens * keys * heads * (2 * r + rope)
    return statically_known_true(absorbed < expanded)  # over a range of shapes: only if it holds for all of it


def _turn_index(cfg: ModelConfig, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The indexer's q or k [b, t, heads, index_head_dim], its leading qk_rope_head_dim dims rotated: in halves
    (DeepSeek-V3.2) or in interleaved pairs, laid out as transformers lays them out (GLM-5)."""
    if not cfg.dsa.rope_interleave:
        return rotate(x, cos, sin)  # a partial rotary: the leading dims turn, the rest pass
    turned, kept = x.split((cfg.qk_rope_head_dim, x.shape[-1] - cfg.qk_rope_head_dim), dim=-1)
    return torch.cat((rotate_interleaved(turned, cos, sin), kept), dim=-1)


def _index_key(cfg: ModelConfig, p: dict[str, torch.Tensor], h: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
    """[b, t, index_head_dim]: each new token's indexer key, wk then its LayerNorm (a bias too), rotated."""
    k = F.layer_norm(F.linear(h, p["self_attn.indexer.wk.weight"]), (cfg.dsa.index_head_dim,),
                     p["self_attn.indexer.k_norm.weight"], p["self_attn.indexer.k_norm.bias"], INDEX_NORM_EPS)
    return _turn_index(cfg, k[:, :, None, :], cos, sin)[:, :, 0]


def _index_query(cfg: ModelConfig, p: dict[str, torch.Tensor], q_low: torch.Tensor, cos: torch.Tensor,
                 sin: torch.Tensor) -> torch.Tensor:
    """[b, t, index_heads, index_head_dim]: the indexer's queries from the query's low-rank latent, rotated."""
    b, t, _ = q_low.shape
    q = F.linear(q_low, p["self_attn.indexer.wq_b.weight"]).view(b, t, cfg.dsa.index_heads, cfg.dsa.index_head_dim)
    return _turn_index(cfg, q, cos, sin)
