"""One rank's share of a mixture-of-experts MLP: a router, the chosen experts, a shared expert.

Routers (ModelConfig.router):
- softmax (Mixtral, Qwen2-MoE, Qwen3-MoE): the softmax over the experts in
  float32, its top k, renormalised when `norm_topk_prob`;
- sigmoid_input (Llama 4): the top k of the logits in the model's dtype, each chosen expert's sigmoid multiplying
  the token it runs on (not its output);
- sigmoid_groups (DeepSeek-V3; MiniMax-M2 with one group): sigmoid scores in
  float32; the choice adds each expert's `e_score_correction_bias` and keeps to
  the best topk_groups of the n_group groups (a group scores the sum of its two
  best); the weights are the uncorrected scores of the chosen, renormalised when
  `norm_topk_prob`, times routed_scaling_factor.
Each expert is a SwiGLU MLP whose intermediate columns are split over the ranks,
so a rank's weighted sum of its experts' partial down projections is summed once
over the ranks, together with the shared expert's partial output (Qwen2-MoE's,
weighted by its replicated sigmoid gate; DeepSeek's shared experts, ungated).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from kiln.core.model.config import ModelConfig
from kiln.core.model import fused_experts
from kiln.core.model.llama4_fields import ROUTER as SCALES_INPUT
from kiln.core.model.module_names import EXPERTS, SHARED_EXPERTS, correction_bias, router_of
from kiln.host.model.layers import choices
from kiln.host.model.layers.choices import EXPERT_SITE
from kiln.host.model.layers.collectives import reduce
from kiln.host.model.layers.quantized import LayerWeights

GATHER_BELOW = 3
"""Outside bfloat16, a step gathers its chosen experts when GATHER_BELOW x its (token, expert) pairs are at
most the experts (a gathered expert's weights are read, copied and read again; for more pairs reading every
expert once costs less)."""

def route(cfg: ModelConfig, p: dict[str, torch.Tensor], module: str,
          x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [n, k] float32, or the model's dtype for Qwen's MoEs, as transformers weighs; chosen
    experts [n, k]) of the tokens x [n, hidden]."""
    if cfg.router in ("sigmoid_groups", "softmax_groups"):
        return _route_groups(cfg, p, module, x)
    if cfg.router == SCALES_INPUT:  # Llama4Router: the top k of the logits, their sigmoid in float32, cast back
        logits = F.linear(x, p[f"{module}.{router_of(cfg)}"])
        chosen = choices.decide(EXPERT_SITE, logits, torch.topk(logits, cfg.experts_per_token, dim=-1).indices)
        return torch.sigmoid(logits.gather(1, chosen).float()).to(x.dtype), chosen
    probs = torch.softmax(F.linear(x, p[f"{module}.gate.weight"]).to(torch.float32), dim=-1)
    chosen = choices.decide(EXPERT_SITE, probs, torch.topk(probs, cfg.experts_per_token, dim=-1).indices)
    weights = probs.gather(1, chosen)
    if cfg.norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if cfg.architecture in ("qwen2_moe", "qwen3_moe"):  # Qwen's MoEs weigh in the model's dtype, Mixtral in float32
        weights = weights.to(x.dtype)
    return weights, chosen


def _route_groups(cfg: ModelConfig, p: dict[str, torch.Tensor], module: str,
                  x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's noaux_tc routing, op for op as DeepseekV3TopkRouter computes it (MiniMax-M2's with one
    group; Mistral 4's over softmax scores, uncorrected)."""
    n, experts, groups = x.shape[0], cfg.num_experts, cfg.num_expert_groups
    if cfg.router == "softmax_groups":  # Mistral4TopkRouter: a softmax in the model's dtype, nothing corrected
        scores = corrected = F.linear(x, p[f"{module}.gate.weight"]).softmax(dim=-1)
    elif cfg.architecture == "minimax_m2":  # MiniMaxM2TopKRouter: the logits in the model's dtype, then float32
        scores = F.linear(x, p[f"{module}.gate.weight"]).to(torch.float32).sigmoid()
    else:
        scores = F.linear(x.to(torch.float32), p[f"{module}.gate.weight"].to(torch.float32)).sigmoid()
    if cfg.router == "sigmoid_groups":
        corrected = scores + p[f"{module}.{correction_bias(cfg)}"].to(torch.float32)
    group_scores = corrected.view(n, groups, experts // groups).topk(2, dim=-1)[0].sum(dim=-1)
    best = torch.topk(group_scores, k=cfg.topk_groups, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores).scatter(1, best, 1).bool()
    keep = keep[:, :, None].expand(n, groups, experts // groups).reshape(n, experts)
    # Mistral 4 masks the other groups with 0 (scores are positive), DeepSeek-V3 with -inf: the same choice
    choice = corrected.masked_fill(~keep, float("-inf"))
    chosen = torch.topk(choice, k=cfg.experts_per_token, dim=-1, sorted=False)[1]
    chosen = choices.decide(EXPERT_SITE, corrected, chosen, groups=groups, keep=cfg.topk_groups)
    weights = scores.gather(1, chosen)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * cfg.routed_scaling_factor, chosen


def mixture_of_experts(cfg: ModelConfig, tp: int, p: dict[str, torch.Tensor], h: torch.Tensor,
                       picks: dict | None = None) -> torch.Tensor:
    """The layer's MLP output [b, t, hidden], summed over the ranks; the experts chosen [b * t, k] go into
    `picks` (kiln.host.model.layers.choices).

    The compute follows the chosen experts. In bfloat16 (`groups_trace`) a step sorts its (token, expert)
    pairs by expert and runs one grouped matrix multiply per projection (`torch._grouped_mm`, each expert
    over its own rows, its weights read in place): its compute is its pairs', its graph one op whatever the
    experts, its memory its pairs' [n * k, I/tp] activations. That holds for decode too, where it reads
    only the chosen experts' weights (measured, eager, one thread: about half the time of gathering them).

    torch 2.13 traces `_grouped_mm` only in bfloat16 over rows of whole 16 bytes, so in any other dtype a
    step of few pairs against the experts (GATHER_BELOW; decode) gathers the chosen experts' weights and
    multiplies each pair by its own, and a wider step (prefill) runs every expert over every token,
    weighted by its routing weight or 0, as one scan over the experts (`_every_expert`): one expert's body
    in the graph, one expert's [n, I/tp] activations at a time, its compute every expert's. The choice is
    made when the graph is traced: at a static shape by its size; over a range of shapes
    (kiln.core.forwards.shape_ranges) it gathers only when every shape of the range would, without a guard that
    would narrow the range. Quantized experts (kiln.host.model.layers.quantized) in a step of few pairs gather
    the chosen experts' stored bytes and scales and dequantize only those, in any dtype; a wider step
    dequantizes the layer's experts and goes on as above.
    """
    module, names = EXPERTS[cfg.architecture]
    projections = [f"{module}.experts.{n}.weight" for n in names]
    b, t, hidden = h.shape
    x = h.reshape(b * t, hidden)
    weights, chosen = route(cfg, p, module, x)
    choices.report(picks, EXPERT_SITE, chosen)
    n, k = chosen.shape
    few = statically_known_true(GATHER_BELOW * n * k <= cfg.num_experts)  # over a range: only if all of it gathers
    scales_input = cfg.router == SCALES_INPUT  # Llama 4: each pair's token times its weight goes in, unweighted out
    if few and isinstance(p, LayerWeights) and p.quantized(projections[0]):
        # Quantized experts: the chosen experts' stored bytes and scales gathered, only those dequantized (read
        # whole, a decode step would dequantize every expert).
        flat = chosen.reshape(-1)
        out = _pairs(x, chosen, *(p.gathered(name, flat) for name in projections))
    else:
        gate_w, up_w, down_w = (p[name] for name in projections)  # [E, I/tp, H], [E, I/tp, H], [E, H, I/tp]
        if fused_experts.input_major(cfg):  # Llama 4's [E, H, I/tp], [E, H, I/tp], [E, I/tp, H]: views
            gate_w, up_w, down_w = (w.transpose(1, 2) for w in (gate_w, up_w, down_w))
        pair_scale = weights if scales_input else None
        out = (_grouped(x, chosen, gate_w, up_w, down_w, pair_scale) if groups_trace(x, gate_w)
               else _gathered(x, chosen, gate_w, up_w, down_w, pair_scale) if few else None)
    if out is None:
        mixed = _every_expert(cfg, x, weights, chosen, gate_w, up_w, down_w, scales_input)
    elif scales_input:
        mixed = out.reshape(n, k, hidden).to(h.dtype).sum(dim=1)
    else:
        mixed = (out.reshape(n, k, hidden) * weights[..., None]).to(h.dtype).sum(dim=1)
    if cfg.shared_expert_intermediate_size:  # every token also runs the shared expert(s): this rank's part
        shared_module, gate = SHARED_EXPERTS[cfg.architecture]
        shared = F.linear(F.silu(F.linear(x, p[f"{shared_module}.gate_proj.weight"]))
                          * F.linear(x, p[f"{shared_module}.up_proj.weight"]), p[f"{shared_module}.down_proj.weight"])
        mixed = mixed + (shared if gate is None else torch.sigmoid(F.linear(x, p[f"{gate}.weight"])) * shared)
    return reduce(mixed, tp).reshape(b, t, hidden)


def groups_trace(x: torch.Tensor, gate_w: torch.Tensor) -> bool:
    """Whether torch.export traces `_grouped_mm` over these tokens [n, H] and experts [E, I/tp, H]: its meta
    function (torch 2.13) takes bfloat16 alone, each row a whole number of 16 bytes (H and I/tp multiples of 8)."""
    return (x.dtype == gate_w.dtype == torch.bfloat16 and x.shape[-1] % 8 == 0 and gate_w.shape[1] % 8 == 0)


def _gathered(x: torch.Tensor, chosen: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor,
              down_w: torch.Tensor, pair_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Each (token, expert) pair's expert output [n * k, H], token-major, unweighted: its expert's weights
    gathered and multiplied by the pair alone (its token times `pair_scale` [n, k] where given: Llama 4)."""
    flat = chosen.reshape(-1)
    return _pairs(x, chosen, gate_w[flat], up_w[flat], down_w[flat], pair_scale)


def _pairs(x: torch.Tensor, chosen: torch.Tensor, gate: torch.Tensor, up: torch.Tensor,
           down: torch.Tensor, pair_scale: torch.Tensor | None = None) -> torch.Tensor:
    """_gathered's multiplies, given each pair's expert weights (gate, up [n * k, I/tp, H], down [n * k, H, I/tp])."""
    rows = x.repeat_interleave(chosen.shape[1], dim=0)[:, None, :]  # [n*k, 1, H]
    if pair_scale is not None:
        rows = rows * pair_scale.reshape(-1, 1, 1)
    act = F.silu(torch.bmm(rows, gate.transpose(1, 2))) * torch.bmm(rows, up.transpose(1, 2))
    return torch.bmm(act, down.transpose(1, 2))[:, 0]


def _grouped(x: torch.Tensor, chosen: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor,
             down_w: torch.Tensor, pair_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Each (token, expert) pair's expert output [n * k, H], in the pairs' order (token-major), unweighted (its
    token times `pair_scale` [n, k] where given: Llama 4)."""
    flat = chosen.reshape(-1)  # [n*k]
    order = torch.argsort(flat, stable=True)  # the pairs sorted by expert
    per_expert = torch.zeros(gate_w.shape[0], dtype=torch.int32, device=x.device).scatter_add_(
        0, flat, torch.ones_like(flat, dtype=torch.int32))
    offs = torch.cumsum(per_expert, 0, dtype=torch.int32)  # where each expert's rows end
    rows = x[order // chosen.shape[1]]  # [n*k, H], grouped by expert
    if pair_scale is not None:
        rows = rows * pair_scale.reshape(-1)[order][:, None]
    act = (F.silu(torch._grouped_mm(rows, gate_w.transpose(1, 2), offs=offs))
           * torch._grouped_mm(rows, up_w.transpose(1, 2), offs=offs))
    out = torch._grouped_mm(act, down_w.transpose(1, 2), offs=offs)
    return torch.empty_like(out).index_copy(0, order, out)  # back in the pairs' order


def _every_expert(cfg: ModelConfig, x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor,
                  gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor,
                  scales_input: bool = False) -> torch.Tensor:
    """Every expert over every token [n, H], one scan over the experts: each weights its activations by its
    routing weights (0 where not chosen) before its down projection, which adds into the sum (addmm: a
    pointwise sum would fuse into one kernel holding every expert's output). `scales_input` (Llama 4): each
    weights its tokens instead (an expert of a token's weight 0 adds 0: no biases)."""
    from torch._higher_order_ops.scan import scan

    dense = torch.zeros(chosen.shape[0], cfg.num_experts, dtype=weights.dtype, device=x.device)
    dense = dense.scatter(1, chosen, weights).t().contiguous()  # [E, n]

    def body(carry, expert):  # the tokens ride in the carry: Inductor (torch 2.13) fails on a tensor closed over
        mixed, rows = carry   # from the layer scan outside ("shape [b, t, H] is invalid for input of size H")
        if scales_input:
            scaled = rows * expert["weight"][:, None]
            act = F.silu(F.linear(scaled, expert["gate"])) * F.linear(scaled, expert["up"])
        else:
            act = (F.silu(F.linear(rows, expert["gate"])) * F.linear(rows, expert["up"]) * expert["weight"][:, None])
        return (torch.addmm(mixed, act.to(rows.dtype), expert["down"].t()), rows.clone()), ()

    return scan(body, (torch.zeros_like(x), x), {"gate": gate_w, "up": up_w, "down": down_w, "weight": dense})[0][0]
