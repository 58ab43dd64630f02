"""DeepSeek-V4's mixture of experts of one rank, as transformers' DeepseekV4SparseMoeBlock computes it.

Scores are sqrt(softplus(router logits)) in the model's dtype. A hash layer's experts are a fixed table's,
`gate.tid2eid[token]`; a top-k layer's are the k best of the scores plus `gate.bias` (the correction bias,
for the choice only). Either way the weights are the chosen experts' scores, renormalised (plus 1e-20) and
times routed_scaling_factor. Every expert and the shared expert are SwiGLU MLPs whose gate is clipped above
at swiglu_limit and whose up is clipped to +-swiglu_limit. Each expert's intermediate columns are split
over the ranks, so the rank's weighted partial sum (with the shared expert's part) is summed once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.core.model.config import ModelConfig
from kiln.host.model.layers import choices
from kiln.host.model.layers.choices import EXPERT_SITE
from kiln.host.model.layers.collectives import reduce


def route(cfg: ModelConfig, p: dict[str, torch.Tensor], x: torch.Tensor,
          tokens: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [n, k] in x's dtype, chosen experts [n, k]) of x [n, hidden]; `tokens` [n]: a hash layer's
    token ids (None on a top-k layer)."""
    scores = F.softplus(F.linear(x, p["ffn.gate.weight"])).sqrt()
    if tokens is not None:
        chosen = p["ffn.gate.tid2eid"][tokens]
    else:
        corrected = scores + p["ffn.gate.bias"]
        chosen = torch.topk(corrected, cfg.experts_per_token, dim=-1, sorted=False).indices
        chosen = choices.decide(EXPERT_SITE, corrected, chosen)
    weights = scores.gather(1, chosen)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, chosen


def _swiglu(cfg: ModelConfig, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate clipped above) x (up clipped to +-swiglu_limit)."""
    limit = cfg.v4.swiglu_limit
    return F.silu(gate.clamp(max=limit)) * up.clamp(min=-limit, max=limit)


def experts(cfg: ModelConfig, tp: int, p: dict[str, torch.Tensor], h: torch.Tensor,
            tokens: torch.Tensor | None, picks: dict | None = None) -> torch.Tensor:
    """The layer's MLP output [b, t, hidden] summed over the ranks; `tokens` [b, t] on a hash layer. A top-k
    layer's chosen experts [b * t, k] go into `picks` (kiln.host.model.layers.choices; a hash layer's are its
    table's, no choice).

    Every expert runs over every token, weighted by its routing weight or 0 (a table may name one expert
    twice for a token: its weights add, as transformers' index_add does)."""
    b, t, hidden = h.shape
    x = h.reshape(b * t, hidden)
    weights, chosen = route(cfg, p, x, None if tokens is None else tokens.reshape(-1))
    if tokens is None:
        choices.report(picks, EXPERT_SITE, chosen)
    w1, w2, w3 = (p[f"ffn.experts.{n}.weight"] for n in ("w1", "w2", "w3"))  # [E, I/tp, H], [E, H, I/tp], [E, I/tp, H]
    act = _swiglu(cfg, torch.einsum("nh,eih->nei", x, w1), torch.einsum("nh,eih->nei", x, w3))
    out = torch.einsum("nei,ehi->neh", act, w2)
    dense = torch.zeros(x.shape[0], cfg.num_experts, dtype=weights.dtype, device=x.device).scatter_add(1, chosen,
                                                                                                      weights)
    mixed = (out * dense[..., None]).to(h.dtype).sum(dim=1)
    shared = F.linear(_swiglu(cfg, F.linear(x, p["ffn.shared_experts.w1.weight"]),
                              F.linear(x, p["ffn.shared_experts.w3.weight"])), p["ffn.shared_experts.w2.weight"])
    return reduce(mixed + shared, tp).reshape(b, t, hidden)
