"""Attention of a decode step over the paged KV cache, the pages read where they lie.

Gathering a step's context (kiln.host.model.layers.step.gather_pages) copies every cached key and value of every
sequence into one tensor per layer, then (grouped-query attention) repeats them for each query head of a
group, before torch's fused attention reads them again: at a long context a decode step spends more on the
copies than on the attention. Here the scores and the weighted sum are written as products summed over an
axis, which Inductor compiles into reductions that load each cached entry through the block table (an
indirect load) where it lies in its page: no gathered copy, no repeated heads. Both run in float32 (as
torch's CPU attention accumulates), the probabilities as transformers' eager attention computes them
(scores, soft cap, mask, softmax).

It is used for steps of at most IN_PLACE_TOKENS new tokens per sequence (decode), fixed per bucket when the
graph is traced: a prefill step multiplies many queries by each key, which a matrix multiply does far better
than a reduction, and its own new keys dominate its context.
"""

from __future__ import annotations

import torch

from kiln.core.model.config import ModelConfig
from kiln.host.model.layers.norms import softcap

IN_PLACE_TOKENS = 1
"""Steps of at most this many new tokens per sequence read the pages in place. Eager (the reference) holds
[b, t, heads, context, head_dim] float32 products where the gathering path holds [b, context, heads,
head_dim] keys: equal at one token, so the checks' memory does not grow."""


def attend_in_place(cfg: ModelConfig, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor,
                    block_table: torch.Tensor, mask: torch.Tensor, scale: float,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax attention [b, t, heads, head_dim] (q's dtype) of q [b, t, heads, head_dim] over the cached
    keys and values of `kv` [2, pages, page_tokens, kv_heads, head_dim] that `block_table` [b, pages_per_seq]
    names, then the step's own k, v [b, t, kv_heads, head_dim], where `mask` [b, 1, t, context + t] allows.
    A query head attends with its group's key head (heads // kv_heads per group). `sinks` [heads] (gpt-oss): a
    logit per head that joins its softmax and attends to nothing."""
    b, t, heads, hd = q.shape
    kv_heads = k.shape[2]
    query = q.reshape(b, t, kv_heads, heads // kv_heads, 1, hd).float()  # [b, t, kvh, group, 1, hd]

    def scores(keys: torch.Tensor) -> torch.Tensor:  # keys [b, n, kvh, hd] -> [b, t, kvh, group, n]
        return (query * keys.permute(0, 2, 1, 3)[:, None, :, None].float()).sum(-1)

    def weighted(probs: torch.Tensor, values: torch.Tensor) -> torch.Tensor:  # -> [b, t, kvh, group, hd]
        return (probs[..., None] * values.permute(0, 2, 1, 3)[:, None, :, None].float()).sum(-2)

    cached_keys, cached_values = (kv[i][block_table].flatten(1, 2) for i in (0, 1))  # indexing, read in place
    context = cached_keys.shape[1]
    s = torch.cat((scores(cached_keys), scores(k)), dim=-1) * scale
    if cfg.attn_softcap is not None:
        s = softcap(s, cfg.attn_softcap)
    s = s.masked_fill(~mask[:, 0, :, None, None, :], float("-inf"))
    if sinks is not None:
        sink = sinks.float().reshape(1, 1, kv_heads, heads // kv_heads, 1).expand(*s.shape[:-1], 1)
        s = torch.cat((s, sink), dim=-1)
    probs = torch.softmax(s, dim=-1)
    out = weighted(probs[..., :context], cached_values) + weighted(probs[..., context:context + t], v)  # no sink
    return out.to(q.dtype).reshape(b, t, heads, hd)
