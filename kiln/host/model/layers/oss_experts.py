"""gpt-oss's mixture of experts, one rank's share, as GptOssMLP computes it.

The router is a linear layer with a bias; a token takes the top k of its logits, weighted by their softmax
(in the model's dtype, as transformers weighs). Each expert is a clamped SwiGLU with biases: gate and up come
from one projection whose columns interleave them (gate j at 2j, up j at 2j + 1), the gate clamped above at
swiglu_limit and up on both sides, then (up + 1) x gate x sigmoid(swiglu_alpha x gate), then the down
projection. The tensors are kiln.core.model.gpt_oss_fields': gate_up [E, H, 2I/tp] (input-major, as the
checkpoint holds it) with its bias [E, 2I/tp], down [E, I/tp, H]; the down projection's bias [E, H] is every
rank's, so it is added once, weighted, after the sum over the ranks. gpt-oss as published holds the two
projections as MXFP4 bytes and scales, output-major; they are dequantized in the graph where the layer reads
them (kiln.host.model.layers.quantized.dequantize: e2m1 codes two a byte, 2^(byte - 127) per 32 inputs), the
chosen experts' alone where a step gathers, and read through input-major views.

The ways of computing follow kiln.host.model.layers.moe (GATHER_BELOW): a step of few (token, expert) pairs
gathers its experts' weights; in bfloat16 a wider step runs torch._grouped_mm over the pairs sorted by expert
(the input-major tensors are its [E, K, N] operands as they lie); otherwise every expert runs over every
token, weighted by its routing weight or 0, one scan over the experts.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from kiln.core.model.config import ModelConfig
from kiln.core.model.gpt_oss_fields import (DOWN, DOWN_BIAS, DOWN_BLOCKS, DOWN_SCALES, GATE_UP, GATE_UP_BIAS,
                                            GATE_UP_BLOCKS, GATE_UP_SCALES, GROUP_BYTES, ROUTER, ROUTER_BIAS)
from kiln.host.model.layers import choices
from kiln.host.model.layers.choices import EXPERT_SITE
from kiln.host.model.layers.collectives import reduce
from kiln.host.model.layers.moe import GATHER_BELOW
from kiln.host.model.layers.quantized import dequantize


def route(cfg: ModelConfig, p: dict[str, torch.Tensor], x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [n, k] in x's dtype, chosen experts [n, k]) of the tokens x [n, hidden]: GptOssTopKRouter's."""
    logits = F.linear(x, p[ROUTER], p[ROUTER_BIAS])
    chosen = choices.decide(EXPERT_SITE, logits, torch.topk(logits, cfg.experts_per_token, dim=-1).indices)
    return torch.softmax(logits.gather(1, chosen), dim=1), chosen


def swiglu(cfg: ModelConfig, gate_up: torch.Tensor) -> torch.Tensor:
    """The clamped SwiGLU [..., I/tp] of interleaved gate and up columns [..., 2I/tp]."""
    gate, up = gate_up[..., ::2].clamp(max=cfg.swiglu_limit), gate_up[..., 1::2]
    up = up.clamp(min=-cfg.swiglu_limit, max=cfg.swiglu_limit)
    return (up + 1) * (gate * torch.sigmoid(gate * cfg.swiglu_alpha))


def oss_experts(cfg: ModelConfig, tp: int, p: dict[str, torch.Tensor], h: torch.Tensor,
                picks: dict | None = None) -> torch.Tensor:
    """The layer's MLP output [b, t, hidden], summed over the ranks; the experts chosen [b * t, k] go into
    `picks` (kiln.host.model.layers.choices)."""
    b, t, hidden = h.shape
    x = h.reshape(b * t, hidden)
    weights, chosen = route(cfg, p, x)
    choices.report(picks, EXPERT_SITE, chosen)
    n, k = chosen.shape
    gate_up_bias = p[GATE_UP_BIAS]
    if statically_known_true(GATHER_BELOW * n * k <= cfg.num_experts):  # over a range: only if all of it gathers
        flat = chosen.reshape(-1)
        gate_up, down = _weights(p, x.dtype, flat)  # each pair's expert's
        rows = x.repeat_interleave(k, dim=0)[:, None, :]  # [n*k, 1, H]
        act = swiglu(cfg, torch.bmm(rows, gate_up) + gate_up_bias[flat][:, None])
        mixed = _weighted(torch.bmm(act, down)[:, 0], weights, h.dtype)
    else:
        gate_up, down = _weights(p, x.dtype)
        mixed = (_weighted(_grouped(cfg, x, chosen, gate_up, gate_up_bias, down), weights, h.dtype)
                 if _groups_trace(x, gate_up, down) else
                 _every_expert(cfg, x, weights, chosen, gate_up, gate_up_bias, down))
    bias = (p[DOWN_BIAS][chosen] * weights[..., None]).to(h.dtype).sum(dim=1)  # [n, H]: every rank's, once
    return (reduce(mixed, tp) + bias).reshape(b, t, hidden)


def _weights(p: dict[str, torch.Tensor], dtype: torch.dtype,
             index: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate_up [..., H, 2I/tp], down [..., I/tp, H]) of experts `index` (all when None): the stacked tensors, or
    MXFP4's bytes and scales (gathered first, so only those experts are dequantized) dequantized to `dtype`,
    input-major views of their output-major rows."""
    if GATE_UP_BLOCKS not in p:
        gate_up, down = p[GATE_UP], p[DOWN]
        return (gate_up, down) if index is None else (gate_up[index], down[index])
    out = []
    for blocks, scales in ((GATE_UP_BLOCKS, GATE_UP_SCALES), (DOWN_BLOCKS, DOWN_SCALES)):
        held, scale = (p[blocks], p[scales]) if index is None else (p[blocks][index], p[scales][index])
        out.append(dequantize(held.flatten(-2).view(torch.int8), scale, (1, GROUP_BYTES), dtype).transpose(-1, -2))
    return out[0], out[1]


def _weighted(out: torch.Tensor, weights: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Each token's sum [n, H] of its pairs' outputs out [n * k, H] (token-major), weighted."""
    n, k = weights.shape
    return (out.reshape(n, k, -1) * weights[..., None]).to(dtype).sum(dim=1)


def _groups_trace(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Whether torch.export traces `_grouped_mm` over these operands (bfloat16, every row a whole number of
    16 bytes: kiln.host.model.layers.moe.groups_trace)."""
    return (x.dtype == gate_up.dtype == torch.bfloat16 and x.shape[-1] % 8 == 0 and down.shape[1] % 8 == 0)


def _grouped(cfg: ModelConfig, x: torch.Tensor, chosen: torch.Tensor, gate_up: torch.Tensor,
             gate_up_bias: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Each (token, expert) pair's expert output [n * k, H] in the pairs' order (token-major), unweighted."""
    flat = chosen.reshape(-1)
    order = torch.argsort(flat, stable=True)  # the pairs sorted by expert
    per_expert = torch.zeros(gate_up.shape[0], dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(per_expert, 0, dtype=torch.int32)
    rows = x[order // chosen.shape[1]]
    act = swiglu(cfg, torch._grouped_mm(rows, gate_up, offs=offs) + gate_up_bias[flat[order]])
    out = torch._grouped_mm(act, down, offs=offs)
    return torch.empty_like(out).index_copy(0, order, out)


def _every_expert(cfg: ModelConfig, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                  gate_up: torch.Tensor, gate_up_bias: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Every expert over every token [n, H], one scan over the experts, each weighting its activations by its
    routing weights (0 where not chosen) before its down projection (kiln.host.model.layers.moe._every_expert)."""
    from torch._higher_order_ops.scan import scan

    dense = torch.zeros(chosen.shape[0], cfg.num_experts, dtype=weights.dtype, device=x.device)
    dense = dense.scatter(1, chosen, weights).t().contiguous()  # [E, n]

    def body(carry, expert):
        mixed, rows = carry
        act = swiglu(cfg, torch.addmm(expert["bias"], rows, expert["gate_up"])) * expert["weight"][:, None]
        return (torch.addmm(mixed, act.to(rows.dtype), expert["down"]), rows.clone()), ()

    return scan(body, (torch.zeros_like(x), x), {"gate_up": gate_up, "bias": gate_up_bias, "down": down,
                                                 "weight": dense})[0][0]
