"""The gated MLP of one rank: SwiGLU (silu) or GeGLU (Gemma's tanh gelu), with optional biases.

gate and up are column-parallel (each rank holds intermediate/tp of their rows),
down is row-parallel: the rank's partial product is summed over the ranks, then
down's bias (if any) is added once.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kiln.core.model.config import ModelConfig
from kiln.host.model.layers.collectives import linear_then_reduce


def activation(cfg: ModelConfig, x: torch.Tensor) -> torch.Tensor:
    return F.silu(x) if cfg.activation == "silu" else F.gelu(x, approximate="tanh")


def gated_mlp(cfg: ModelConfig, tp: int, p: dict[str, torch.Tensor], h: torch.Tensor,
              module: str = "mlp") -> torch.Tensor:
    """down(act(gate(h)) * up(h)) summed over the ranks; `module` prefixes the projections' names."""
    gate = F.linear(h, p[f"{module}.gate_proj.weight"], p.get(f"{module}.gate_proj.bias"))
    up = F.linear(h, p[f"{module}.up_proj.weight"], p.get(f"{module}.up_proj.bias"))
    return linear_then_reduce(activation(cfg, gate) * up, p[f"{module}.down_proj.weight"],
                              p.get(f"{module}.down_proj.bias"), tp)
