"""The lightning indexer: which tokens (or compressed entries) each query attends to, the best by its score.

DeepSeek-V4's CSA layers (over compressed entries, kiln.host.model.layers.compressed_attention) and DeepSeek sparse
attention (DeepSeek-V3.2, GLM-5: over every cached token, kiln.host.model.layers.latent_attention) score alike:
index heads q_h [b, t, heads, d] against one key per candidate k [b, n, d],

    score = sum_h w_h relu(q_h . k) / sqrt(d)        (in float32; w [b, t, heads] from the query's token)

and a query keeps the best top-k of the candidates ready for it. The picks are a choice site
(kiln.host.model.layers.choices: reported as outputs, forced only by the eager check); a pick past the ready
candidates is none (index n).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from kiln.host.model.layers import choices
from kiln.host.model.layers.choices import INDEXER_SITE


def scores(q: torch.Tensor, keys: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """[b, t, n] float32: each query's score of each candidate (q [b, t, heads, d], keys [b, n, d], weights
    [b, t, heads] float32, already scaled as the model scales them)."""
    per_head = F.relu(torch.einsum("bthd,bnd->bthn", q.float(), keys.float())) * q.shape[-1] ** -0.5
    return (per_head * weights[..., None]).sum(dim=2)


def best(score: torch.Tensor, ready: torch.Tensor, topk: int, picks: dict | None = None,
         width: str = "at_most_n") -> torch.Tensor:
    """[b, t, n] bool: the candidates each query attends to, the `topk` best by `score` [b, t, n] among those
    `ready` [b, t, n] for it (fewer when fewer are ready). The picks go into `picks`, [b, t, k]: k is
    min(topk, n) (`width` "at_most_n": DeepSeek-V4's, whose n is fixed), or topk whatever n is ("topk": a forward
    over a cache whose length is dynamic, the missing ones none)."""
    b, t, n = score.shape
    score = score.masked_fill(~ready, float("-inf"))
    ranked, ok = score, ready
    if width == "topk" and not statically_known_true(n >= topk):  # room for topk picks, the extra never ready
        ranked = torch.cat((score, score.new_full((b, t, topk), float("-inf"))), dim=-1)
        ok = torch.cat((ready, ready.new_zeros((b, t, topk))), dim=-1)
    chosen = ranked.topk(topk if width == "topk" else min(topk, n), dim=-1).indices
    chosen = torch.where(ok.gather(-1, chosen), chosen, n)  # a pick among candidates not ready: none
    chosen = choices.decide(INDEXER_SITE, score, chosen)
    choices.report(picks, INDEXER_SITE, chosen)
    return torch.zeros(b, t, n + 1, dtype=torch.bool, device=score.device).scatter(-1, chosen, True)[..., :n]
