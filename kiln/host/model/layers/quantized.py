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

DeepSeek-V4-Flash's variant (kiln.core.model.quant): UE8M0 scales are held as
their bytes and the graph takes 2^(byte - 127); an FP4 expert's int8 bytes are
unpacked in the graph, two e2m1 codes a byte (low nibble first), each code's
value computed from its bits (no table), then scaled per 32 inputs.

`quantize` is the other direction (random checkpoints, tests): a scale per
block of amax / 448, the largest float8_e4m3fn (a power of two for UE8M0; FP4:
amax / 6 per 32 inputs, rounded to the nearest e2m1 value).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import torch

from kiln.core.model import quant
from kiln.core.model.config import ModelConfig
from kiln.core.model.contract import scale_grid

FP8_MAX = 448.0
"""The largest finite float8_e4m3fn."""


FP4_MAX = 6.0
"""The largest e2m1 magnitude."""
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
"""The e2m1 magnitudes of codes 0-7 (bit 3 is the sign)."""


def scale_values(scales: torch.Tensor) -> torch.Tensor:
    """Block scales in float32: float32 ones as they are, UE8M0 bytes (uint8) as 2^(byte - 127)."""
    if scales.dtype == torch.uint8:
        return torch.exp2(scales.to(torch.float32) - 127.0)
    return scales.to(torch.float32)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """float32 [..., cols * 2] of int8 [..., cols]: two e2m1 codes a byte, the low nibble first. A code's value
    from its bits: sign (bit 3) x (exponent e = bits 1-2, mantissa m = bit 0) -> m / 2 when e is 0, else
    2^(e - 1) x (1 + m / 2)."""
    u = packed.view(torch.uint8).to(torch.int32)
    codes = torch.stack([u & 15, u >> 4], dim=-1).flatten(-2)
    e, m = ((codes >> 1) & 3).to(torch.float32), (codes & 1).to(torch.float32)
    magnitude = torch.where(e == 0, 0.5 * m, torch.exp2(e - 1.0) * (1.0 + 0.5 * m))
    return torch.where(codes >= 8, -magnitude, magnitude)


def dequantize(weight: torch.Tensor, scales: torch.Tensor, grid: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """weight [..., rows, cols] (float8, or FP4 bytes: int8 [..., rows, cols / 2], `grid` in bytes) times its
    scales [..., ceil(rows / grid[0]), ceil(cols / grid[1])], each scale over a grid[0] x grid[1] sub-block (the
    last ones partial), computed in float32 and rounded to `dtype`."""
    if weight.dtype == torch.int8:
        values, grid = unpack_fp4(weight), (grid[0], grid[1] * 2)
    else:
        values = weight.to(torch.float32)
    rows, cols = values.shape[-2:]
    *lead, scale_rows, scale_cols = scales.shape
    every = scale_values(scales)[..., :, None, :, None].expand(*lead, scale_rows, grid[0], scale_cols, grid[1])
    every = every.reshape(*lead, scale_rows * grid[0], scale_cols * grid[1])[..., :rows, :cols]
    return (values * every).to(dtype)


def _power_of_two(x: torch.Tensor) -> torch.Tensor:
    """The UE8M0 byte of the smallest power of two at least x (at least 2^-126)."""
    exponent = torch.ceil(torch.log2(x.clamp(min=2.0 ** -126)))
    return (exponent + 127).to(torch.uint8)


def quantize(weight: torch.Tensor, block: tuple[int, int], ue8m0: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, scales) of `weight` [rows, cols] in `block` blocks, the edges partial: each
    block's scale is its largest magnitude / FP8_MAX (float32; or, `ue8m0`, the power of two at least that, as
    its byte), so dequantize(...) gives it back to float8's precision."""
    rows, cols = weight.shape
    br, bc = block
    padded = torch.zeros(-(-rows // br) * br, -(-cols // bc) * bc, dtype=torch.float32)
    padded[:rows, :cols] = weight.to(torch.float32)
    blocks = padded.view(padded.shape[0] // br, br, padded.shape[1] // bc, bc)
    scales = (blocks.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=1e-12)
    if ue8m0:
        scales = _power_of_two(scales)
    q = (blocks / scale_values(scales)[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(padded.shape)[:rows, :cols].contiguous(), scales


def quantize_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(int8 [rows, cols / 2], UE8M0 bytes [rows, cols / 32]) of `weight` [rows, cols]: per 32 inputs of a row the
    power of two at least amax / 6, each value rounded to the nearest e2m1 code, two codes a byte (low first)."""
    rows, cols = weight.shape
    groups = weight.to(torch.float32).reshape(rows, cols // quant.FP4_GROUP, quant.FP4_GROUP)
    scales = _power_of_two(groups.abs().amax(dim=-1) / FP4_MAX)
    x = (groups / scale_values(scales)[..., None]).reshape(rows, cols)
    code = (x.abs()[..., None] - torch.tensor(E2M1)).abs().argmin(dim=-1)
    code = code | ((x < 0) & (code > 0)).to(torch.int64) << 3
    return (code[:, 0::2] | code[:, 1::2] << 4).to(torch.uint8).view(torch.int8).contiguous(), scales


def quantize_like(q: quant.WeightQuant, name: str, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(stored weight, scales) of checkpoint tensor `name` in format `q`, from its float `weight`."""
    if quant.is_fp4(q, name):
        return quantize_fp4(weight)
    return quantize(weight, q.block, ue8m0=q.scale_fmt == "ue8m0")


class LayerWeights(Mapping):
    """A layer's tensors by checkpoint suffix (`p`), as a layer reads them: a quantized projection dequantized to
    `dtype` when read (`p[name]`, `p.get(name)`), its scales not among the names."""

    def __init__(self, cfg: ModelConfig, tp: int, p: Mapping[str, torch.Tensor], dtype: torch.dtype):
        self._cfg, self._tp, self._p, self._dtype = cfg, tp, p, dtype

    def __getitem__(self, name: str) -> torch.Tensor:
        if quant.is_quantized(self._cfg.quant, name):
            return dequantize(self._p[name], self._p[quant.scale_of(name, self._cfg.quant)],
                              scale_grid(self._cfg, self._tp, name), self._dtype)
        return self._p[name]

    def quantized(self, name: str) -> bool:
        """Whether `name` is held quantized (read through `[name]` dequantized, or `gathered`)."""
        return quant.is_quantized(self._cfg.quant, name)

    def gathered(self, name: str, index: torch.Tensor) -> torch.Tensor:
        """Entries `index` of quantized stacked weight `name` (its leading dimension: experts), dequantized: the
        stored bytes and their scales gathered first, so only those entries are dequantized."""
        scales = self._p[quant.scale_of(name, self._cfg.quant)]
        return dequantize(self._p[name][index], scales[index], scale_grid(self._cfg, self._tp, name), self._dtype)

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
