"""Quantized checkpoint weights: the format Kiln reads, which tensors it quantizes, their scales and a rank's grid.

Pure: no torch import. One format today, FP8 blocks (`fp8_blocks`), as DeepSeek-V3 and Qwen3's FP8 checkpoints
are published (config.json's quantization_config {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme":
"dynamic", "weight_block_size": [rows, cols]}; kiln.core.model.hf_config.quantization reads it):
- every projection of every decoder layer (QUANTIZED: attention's, the MLP's, each expert's, the shared
  expert's) is `<module>.weight`, float8_e4m3fn [out, in], beside `<module>.weight_scale_inv`, float32
  [ceil(out / rows), ceil(in / cols)]: the weight is weight x scale_inv block by block, the blocks at the
  bottom and right edges partial (DeepSeek-V3's kv_a_proj_with_mqa has 576 rows: 4 blocks of 128, one of 64);
- embeddings, norms, routers, Qwen2-MoE's shared-expert gate and the output head are not quantized.

A rank keeps its projections in float8 and their scales as package constants of their own; the forward
dequantizes them in the graph, a layer at a time within the scan (kiln.host.model.layers.quant), into the
compute dtype (ModelConfig.dtype). A rank's share of a weight (kiln.core.model.contract.shard_slice) need not
start on a block: at tp 4, Qwen3-30B-A3B's 768-wide experts give each rank 192 rows, 1.5 blocks of 128. So a
rank's scales are on a grid of their own, the same on every rank (one graph serves every rank): along a
dimension the rank holds n entries of, cut from the tensor, sub-blocks of g = gcd(block, n) entries, each
inside one checkpoint block, whose scale it repeats (block / g times); along a dimension held whole, the
checkpoint's blocks. Where n is a multiple of the block (DeepSeek-V3 at tp 8), g is the block and a rank's
scales are a plain cut of the checkpoint's (`scale_cut`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.core.errors import BadInput

FP8_BLOCKS = "fp8_blocks"
METHODS = (FP8_BLOCKS,)
"""The quantized formats Kiln reads (WeightQuant.method)."""

WEIGHT_DTYPE = "float8_e4m3fn"
"""The dtype a quantized weight is held in: in the checkpoint (safetensors F8_E4M3), a rank's memory and the
package's constants."""
SCALE_DTYPE = "float32"
"""The dtype of a block's scale (safetensors F32)."""
SCALE_SUFFIX = ".weight_scale_inv"
"""A quantized `<module>.weight`'s scales are `<module>.weight_scale_inv` (the weight is weight x scale_inv)."""

QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3",
             "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj")
"""The modules whose weight is quantized: a decoder layer's projections (attention's, latent attention's, the
MLP's, the experts' and the shared expert's); a router (`gate`) and a shared expert's gate are not."""


@dataclass(frozen=True)
class WeightQuant:
    """How a checkpoint's projections are quantized (ModelConfig.quant)."""

    method: str
    """One of METHODS: fp8_blocks (float8_e4m3fn weights, a float32 scale per block)."""
    block: tuple[int, int]
    """(rows, cols) of one scale's block (weight_block_size)."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise BadInput(f"quantization: method {self.method!r} is not one Kiln reads ({', '.join(METHODS)}).")
        block = tuple(self.block) if isinstance(self.block, (list, tuple)) else self.block
        if not isinstance(block, tuple) or len(block) != 2 or not all(
                isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
            raise BadInput(f"quantization: the block must be two positive integers (rows, cols), got {self.block!r}.")
        object.__setattr__(self, "block", block)


def is_quantized(quant: WeightQuant | None, name: str) -> bool:
    """`name` (a checkpoint tensor, a package constant or a stacked constant's suffix) is a quantized weight."""
    if quant is None or not name.endswith(".weight") or name.startswith("lm_head"):
        return False
    parts = name.rsplit(".", 2)
    return len(parts) == 3 and parts[-2] in QUANTIZED


def is_scale(name: str) -> bool:
    """`name` is a quantized weight's scales."""
    return name.endswith(SCALE_SUFFIX)


def scale_of(weight: str) -> str:
    """The scales' name of quantized weight `weight` (`...q_proj.weight` -> `...q_proj.weight_scale_inv`)."""
    return weight.removesuffix(".weight") + SCALE_SUFFIX


def weight_of(scale: str) -> str:
    """The weight whose scales are `scale`."""
    return scale.removesuffix(SCALE_SUFFIX) + ".weight"


def scale_shape(quant: WeightQuant, shape: tuple[int, ...]) -> tuple[int, ...]:
    """The checkpoint scales' shape of a weight of `shape` ([..., out, in]): a scale per block, edges partial."""
    *lead, rows, cols = shape
    return (*lead, -(-rows // quant.block[0]), -(-cols // quant.block[1]))


def scale_grid(quant: WeightQuant, cut: tuple[int, int, int] | None) -> tuple[int, int]:
    """(rows, cols) of the sub-block each of a rank's scales covers, for a 2-D weight cut to `cut` ((dim, start,
    stop) along dimension 0 or 1, or None: held whole): gcd(block, n) along the cut dimension of n entries, the
    block along the other. The same on every rank."""
    grid = list(quant.block)
    if cut is not None:
        grid[cut[0]] = math.gcd(grid[cut[0]], cut[2] - cut[1])
    return grid[0], grid[1]


def scale_cut(quant: WeightQuant, cut: tuple[int, int, int] | None) -> tuple[int, int, int, int] | None:
    """A rank's cut of the checkpoint scales of a 2-D weight cut to `cut`: (dim, start, stop, repeat), entries
    [start, stop) of dimension `dim` of the scales with each entry of that dimension repeated `repeat` times (a
    scale per sub-block of scale_grid: a block's scale for each sub-block inside it); None when held whole.
    start and stop are whole: the rank's share starts at rank x n, a multiple of its sub-block."""
    if cut is None:
        return None
    dim, start, stop = cut
    grid = scale_grid(quant, cut)[dim]
    return dim, start // grid, stop // grid, quant.block[dim] // grid
