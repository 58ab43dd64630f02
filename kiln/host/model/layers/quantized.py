"""FP8-block weights in the graph: a layer's quantized projections, dequantized where the layer reads them.

The format and which tensors it covers are kiln.core.model.quant's. A rank holds
each quantized projection in float8_e4m3fn beside its float32 scales, one per
sub-block of its grid (kiln.core.model.contract.scale_grid). The decoder hands
each layer its tensors through `layer_weights`: a quantized projection read by
the layer is dequantized there, in the graph, to the compute dtype (weight x
scale in float32, rounded once, as transformers' and DeepSeek's dequantization
do), so within the scan only one layer's dequantized weights exist at a time,
never a whole dequantized copy of the rank's weights. The layers themselves
never see a scale. On CPU the dequantize is a kernel of its own, writing the
weight in the compute dtype each call (Inductor fuses no prologue into a CPU
GEMM); it sits inside the scan's body, so freezing's constant folding (which
works on the top-level graph) cannot turn the float8 constants into float32
ones.

`quantize` is the other direction (random checkpoints, tests): a scale per
block of amax / 448, the largest float8_e4m3fn.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from kiln.core.model import quant
from kiln.core.model.config import ModelConfig
from kiln.core.model.contract import scale_grid

FP8_MAX = 448.0
"""The largest finite float8_e4m3fn."""


def dequantize(weight: torch.Tensor, scales: torch.Tensor, grid: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """weight [..., rows, cols] (float8) times its scales [..., ceil(rows / grid[0]), ceil(cols / grid[1])], each
    scale over a grid[0] x grid[1] sub-block (the last ones partial), computed in float32 and rounded to `dtype`."""
    rows, cols = weight.shape[-2:]
    *lead, scale_rows, scale_cols = scales.shape
    every = scales.to(torch.float32)[..., :, None, :, None].expand(*lead, scale_rows, grid[0], scale_cols, grid[1])
    every = every.reshape(*lead, scale_rows * grid[0], scale_cols * grid[1])[..., :rows, :cols]
    return (weight.to(torch.float32) * every).to(dtype)


def quantize(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scales) of `weight` [rows, cols] in `block` blocks, the edges partial: each
    block's scale is its largest magnitude / FP8_MAX, so dequantize(...) gives it back to float8's precision."""
    rows, cols = weight.shape
    br, bc = block
    padded = torch.zeros(-(-rows // br) * br, -(-cols // bc) * bc, dtype=torch.float32)
    padded[:rows, :cols] = weight.to(torch.float32)
    blocks = padded.view(padded.shape[0] // br, br, padded.shape[1] // bc, bc)
    scales = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    q = (blocks / scales[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(padded.shape)[:rows, :cols].contiguous(), scales


class LayerWeights(Mapping):
    """A layer's tensors by checkpoint suffix (`p`), as a layer reads them: a quantized projection dequantized to
    `dtype` when read (`p[name]`, `p.get(name)`), its scales not among the names."""

    def __init__(self, cfg: ModelConfig, tp: int, p: Mapping[str, torch.Tensor], dtype: torch.dtype):
        self._cfg, self._tp, self._p, self._dtype = cfg, tp, p, dtype

    def __getitem__(self, name: str) -> torch.Tensor:
        if quant.is_quantized(self._cfg.quant, name):
            return dequantize(self._p[name], self._p[quant.scale_of(name)], scale_grid(self._cfg, self._tp, name),
                              self._dtype)
        return self._p[name]

    def __contains__(self, name: object) -> bool:
        return name in self._p and not quant.is_scale(str(name))

    def __iter__(self) -> Iterator[str]:
        return (name for name in self._p if not quant.is_scale(name))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def layer_weights(cfg: ModelConfig, tp: int, p: Mapping[str, torch.Tensor],
                  dtype: torch.dtype) -> Mapping[str, torch.Tensor]:
    """What a layer reads of its tensors `p`: `p` itself, or, for a quantized checkpoint, LayerWeights over it."""
    return p if cfg.quant is None else LayerWeights(cfg, tp, p, dtype)
