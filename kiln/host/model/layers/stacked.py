"""A run of same-shaped decoder layers as tensors stacked along a leading layer dimension, and the scan's phases.

A run's state dict names are the checkpoint suffixes (`self_attn.q_proj.weight`,
shape [layers, ...]); the package constant `model.runs.<index>.<suffix>` stacks
the checkpoint tensors `model.layers.<i>.<suffix>` of its layers
(kiln.core.model.layer_runs). Every decoder scans these runs: a segment whose
kinds alternate takes every period-th layer slice per phase (`every`) and puts
the phases' outputs back in layer order (`interleave`).
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.core.model import quant
from kiln.core.model.config import ModelConfig
from kiln.core.model.contract import RUN_PREFIX, constant_dtype, constant_shapes, is_expert
from kiln.core.model.layer_runs import Segment, layer_runs, segments


def keep_own_dtypes(module: nn.Module, cfg: ModelConfig) -> nn.Module:
    """`module` with the parameters the contract keeps in a dtype of their own (constant_dtype: float32, or a
    quantized checkpoint's float8 and its float32 scales) cast back to it after a cast of the whole module."""
    for name, param in module.named_parameters():
        own = constant_dtype(cfg, name)
        if own != cfg.dtype and own != str(param.dtype).removeprefix("torch."):
            param.data = param.data.to(getattr(torch, own))
    return module


class Holder(nn.Module):
    """A bare container, so stacked tensors keep their checkpoint suffix as their module path."""


def _initial(suffix: str, shape: tuple[int, ...]) -> torch.Tensor:
    """A stacked parameter's initial value, from the global generator as nn.Linear's would be (norms start at
    one, everything else at random with a 1/sqrt(fan-in) scale): a model built without weights computes
    something, so comparing two forwards of it shows something. Free on the meta device."""
    if suffix.endswith("norm.weight"):
        return torch.ones(shape)
    return torch.randn(shape) * shape[-1] ** -0.5


class LayerRun(nn.Module):
    """Run `index` of same-shaped decoder layers of one rank, each tensor stacked along a leading layer dimension.

    Its state dict names are the checkpoint suffixes (`self_attn.q_proj.weight`, shape [layers, ...]), so
    the package constant `model.runs.<index>.<suffix>` stacks the checkpoint tensors `model.layers.<i>.<suffix>`
    of its layers (kiln.core.model.layer_runs).
    """

    def __init__(self, cfg: ModelConfig, tp: int, index: int, rank: int = 0):
        super().__init__()
        self.layers = layer_runs(cfg)[index]
        prefix = f"{RUN_PREFIX}{index}."
        shapes = constant_shapes(cfg, tp, rank)
        self.suffixes = [n.removeprefix(prefix) for n in shapes if n.startswith(prefix)]
        for suffix in self.suffixes:
            owner = self
            *path, leaf = suffix.split(".")
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, Holder())
                owner = getattr(owner, part)
            own = constant_dtype(cfg, prefix + suffix)
            if own == "int64":  # an index table (DeepSeek-V4's tid2eid)
                owner.register_buffer(leaf, torch.zeros(shapes[prefix + suffix], dtype=torch.int64))
            elif own == "uint8":  # gpt-oss's MXFP4: random e2m1 bytes, scales 2^-6 (kiln.core.model.gpt_oss_fields)
                shape = shapes[prefix + suffix]
                initial = (torch.full(shape, 121) if suffix.endswith("_scales") else torch.randint(0, 256, shape))
                owner.register_parameter(leaf, nn.Parameter(initial.to(torch.uint8), requires_grad=False))
            elif quant.is_scale(suffix):  # a quantized projection's scales: 1 / 64 (UE8M0: its byte, 127 - 6)
                initial = torch.full(shapes[prefix + suffix], 121 if own == quant.E8M0_DTYPE else 1 / 64)
                owner.register_parameter(leaf, nn.Parameter(initial.to(getattr(torch, own)), requires_grad=False))
            elif own in (quant.WEIGHT_DTYPE, quant.FP4_DTYPE):  # a quantized projection (x 64; FP4: random bytes)
                shape = shapes[prefix + suffix]
                initial = (torch.randint(-128, 128, shape, dtype=torch.int8) if own == quant.FP4_DTYPE
                           else (_initial(suffix, shape) * 64).to(getattr(torch, own)))
                owner.register_parameter(leaf, nn.Parameter(initial, requires_grad=False))
            else:
                owner.register_parameter(leaf, nn.Parameter(_initial(suffix, shapes[prefix + suffix])))

    def stacked(self) -> dict[str, torch.Tensor]:
        """suffix -> the stacked tensor [layers, ...]; experts' projections, stacked layers x experts along
        one dimension, viewed as [layers, experts, ...]."""
        out = {}
        for suffix in self.suffixes:
            module, _, leaf = suffix.rpartition(".")
            w = getattr(self.get_submodule(module) if module else self, leaf)
            out[suffix] = w.view(len(self.layers), -1, *w.shape[-2:]) if is_expert(suffix) else w  # fused: as it is
        return out


def segment_runs(cfg: ModelConfig, runs: nn.ModuleList) -> list[tuple[Segment, list[LayerRun]]]:
    """Each segment of `cfg`'s layers with its runs (kiln.core.model.layer_runs: run j is runs[j]), in phase order."""
    out, j = [], 0
    for segment in segments(cfg):
        out.append((segment, list(runs[j:j + segment.period])))
        j += segment.period
    return out


def every(stacked: torch.Tensor, k: int, period: int) -> torch.Tensor:
    """Phase k of a segment's layer slices: its layers k, k + period, ..."""
    return stacked if period == 1 else stacked[k::period]


def interleave(phases: list[torch.Tensor]) -> torch.Tensor:
    """The phases' per-layer outputs [repeats, ...] each, back in layer order [repeats x period, ...]."""
    return phases[0] if len(phases) == 1 else torch.stack(phases, dim=1).flatten(0, 1)
