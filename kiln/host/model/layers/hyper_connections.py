"""DeepSeek-V4's manifold-constrained hyper-connections (mHC), as transformers' DeepseekV4HyperConnection and
DeepseekV4HyperHead compute them.

The residual is hc_mult streams [b, t, n, hidden]. Before a block, one linear map of the RMS-normed,
flattened streams gives per token: `pre` (n weights collapsing the streams into the block's input),
`post` (n weights expanding the block's output back to n streams) and `comb` (an n x n mixing of the
input streams into the output ones), made doubly stochastic by hc_sinkhorn_iters Sinkhorn iterations
(the first a column normalisation, then row and column each time). Every mixing weight is computed in
float32 (transformers keeps these modules in float32 whatever the model's dtype). Replicated on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.core.model.config import ModelConfig


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x scaled by the reciprocal RMS of its last dim, computed in float32 and cast to x's dtype first."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def mix_weights(cfg: ModelConfig, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
                streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(post [b, t, n] float32, comb [b, t, n, n] float32, the collapsed block input [b, t, hidden] in
    streams' dtype) of `streams` [b, t, n, hidden], from one hyper-connection's fn [(2 + n) n, n hidden],
    base [(2 + n) n] and scale [3]."""
    v4, n = cfg.v4, cfg.v4.hc_mult
    b, t = streams.shape[:2]
    flat = unweighted_rms_norm(streams.reshape(b, t, -1).float(), cfg.rms_norm_eps)
    pre_w, post_w, comb_w = F.linear(flat, fn).split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + v4.hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(b, t, n, n) * scale[2] + comb_b.view(n, n), dim=-1) + v4.hc_eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + v4.hc_eps)
    for _ in range(v4.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + v4.hc_eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + v4.hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
    return post, comb, collapsed


def expand(post: torch.Tensor, comb: torch.Tensor, block_out: torch.Tensor, streams: torch.Tensor) -> torch.Tensor:
    """The streams after a block: its output [b, t, hidden] expanded by `post`, plus the input streams mixed
    by comb transposed (stream k takes sum_j comb[j, k] x stream j), in streams' dtype."""
    dtype = streams.dtype
    return post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(-2) + torch.matmul(comb.to(dtype).transpose(-1, -2),
                                                                                  streams)


def hyper_head(cfg: ModelConfig, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
               streams: torch.Tensor) -> torch.Tensor:
    """The final collapse [b, t, hidden] of `streams` [b, t, n, hidden] (the hyper-head: sigmoid weights of the
    normed streams, plus hc_eps)."""
    flat = unweighted_rms_norm(streams.flatten(2).float(), cfg.rms_norm_eps)
    # fn, scale and base are float32 already (the contract keeps them so): no op of theirs alone, which a
    # weightless package would fold at compile time from the placeholders instead of the rank's weights.
    pre = torch.sigmoid(F.linear(flat, fn) * scale + base) + cfg.v4.hc_eps
    return (pre.unsqueeze(-1) * streams).sum(dim=2).to(streams.dtype)
