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

gpt-oss's MXFP4 (`mxfp4`, quantization_config {"quant_method": "mxfp4"}) quantizes its experts alone, in
tensors of their own (kiln.core.model.gpt_oss_fields: `<proj>_blocks` and `<proj>_scales`); every `.weight` of
such a checkpoint is unquantized.

DeepSeek-V4-Flash's variant of the format (WeightQuant.scale_fmt "ue8m0", .experts "fp4"):
- UE8M0 scales: each block's scale a power of two stored as float8_e8m0fnu (safetensors F8_E8M0) and named
  `<module>.scale` (transformers renames it weight_scale_inv); a rank holds the bytes as uint8 (E8M0_DTYPE)
  and the graph takes 2^(byte - 127);
- FP4 experts: each routed expert's `<module>.weight` int8 [out, in / 2] (FP4_DTYPE), two e2m1 codes a byte,
  the even input in the low nibble, beside `<module>.scale` E8M0 [out, in / 32]: a scale per 32 inputs of a
  row. Its shapes here are the stored ones (in / 2 columns), so its block is 1 x 16 stored columns
  (`block_of`), and a rank's cut of its inputs (w2 at tp > 1) is a cut of whole bytes.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.core.errors import BadInput

FP8_BLOCKS = "fp8_blocks"
MXFP4 = "mxfp4"
SCALE_FORMATS = ("float", "ue8m0")
"""How a block's scale is stored (WeightQuant.scale_fmt): float32, or UE8M0 (a power of two, one byte)."""
EXPERT_FORMATS = ("fp8", "fp4")
"""How routed experts' projections are stored (WeightQuant.experts): FP8 blocks like the rest, or FP4."""
FP4_DTYPE = "int8"
"""The dtype an FP4 projection is held in: two e2m1 codes a byte (safetensors I8)."""
E8M0_DTYPE = "uint8"
"""The dtype a UE8M0 scale is held in: its byte, the exponent + 127 (safetensors F8_E8M0, read as bytes)."""
FP4_GROUP = 32
"""Inputs per FP4 scale."""
UE8M0_SUFFIX = ".scale"
"""A UE8M0 checkpoint's scales are `<module>.scale` (DeepSeek-V4-Flash's name)."""
METHODS = (FP8_BLOCKS, MXFP4)
"""The quantized formats Kiln reads (WeightQuant.method). MXFP4 (gpt-oss's experts) has tensors of its own,
kiln.core.model.gpt_oss_fields': no `<module>.weight` is quantized in its sense here."""

WEIGHT_DTYPE = "float8_e4m3fn"
"""The dtype a quantized weight is held in: in the checkpoint (safetensors F8_E4M3), a rank's memory and the
package's constants."""
SCALE_DTYPE = "float32"
"""The dtype of a block's scale (safetensors F32)."""
SCALE_SUFFIX = ".weight_scale_inv"
"""A quantized `<module>.weight`'s scales are `<module>.weight_scale_inv` (the weight is weight x scale_inv)."""

QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3",
             "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "wq_a", "wq_b", "wkv", "wo_a", "wo_b")
"""The modules whose weight is quantized: a decoder layer's projections (attention's, latent attention's, the
MLP's, the experts' and the shared expert's; DeepSeek-V4's wq_a, wq_b, wkv, wo_a, wo_b and its indexer's wq_b);
a router (`gate`), a shared expert's gate and DeepSeek-V4's compressors (`.compressor.`: its indexer's too)
and indexer weights_proj are not (transformers' DeepseekV4PreTrainedModel._keep_in_fp32_modules)."""
UNQUANTIZED_WITHIN = ".compressor."
"""A projection under a DeepSeek-V4 compressor is published unquantized, whatever its name."""


@dataclass(frozen=True)
class WeightQuant:
    """How a checkpoint's projections are quantized (ModelConfig.quant)."""

    method: str
    """One of METHODS: fp8_blocks (float8_e4m3fn weights, a scale per block), or mxfp4 (gpt-oss's experts: e2m1
    codes two a byte, a power-of-two scale per 32 inputs; block (1, 32))."""
    block: tuple[int, int]
    """(rows, cols) of one scale's block (weight_block_size)."""
    scale_fmt: str = "float"
    """One of SCALE_FORMATS: float32 `weight_scale_inv`, or UE8M0 `.scale` (DeepSeek-V4-Flash)."""
    experts: str = "fp8"
    """One of EXPERT_FORMATS: routed experts as FP8 blocks, or FP4 with a UE8M0 scale per 32 inputs."""

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise BadInput(f"quantization: method {self.method!r} is not one Kiln reads ({', '.join(METHODS)}).")
        block = tuple(self.block) if isinstance(self.block, (list, tuple)) else self.block
        if not isinstance(block, tuple) or len(block) != 2 or not all(
                isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
            raise BadInput(f"quantization: the block must be two positive integers (rows, cols), got {self.block!r}.")
        object.__setattr__(self, "block", block)
        if self.scale_fmt not in SCALE_FORMATS:
            raise BadInput(f"quantization: scale_fmt {self.scale_fmt!r} is not one Kiln reads "
                           f"({', '.join(SCALE_FORMATS)}).")
        if self.experts not in EXPERT_FORMATS:
            raise BadInput(f"quantization: expert_dtype {self.experts!r} is not one Kiln reads "
                           f"({', '.join(EXPERT_FORMATS)}).")
        if self.experts == "fp4" and self.scale_fmt != "ue8m0":
            raise BadInput("quantization: FP4 experts come with UE8M0 scales (scale_fmt 'ue8m0'), as "
                           "DeepSeek-V4-Flash publishes them.")


def is_quantized(quant: WeightQuant | None, name: str) -> bool:
    """`name` (a checkpoint tensor, a package constant or a stacked constant's suffix) is a quantized weight."""
    if quant is None or quant.method == MXFP4 or not name.endswith(".weight") or name.startswith("lm_head"):
        return False
    parts = name.rsplit(".", 2)
    return len(parts) == 3 and parts[-2] in QUANTIZED and UNQUANTIZED_WITHIN not in name


def is_fp4(quant: WeightQuant | None, name: str) -> bool:
    """`name` is a quantized weight held as FP4 (a routed expert's projection of an `experts` "fp4" checkpoint;
    a shared expert's is FP8)."""
    return quant is not None and quant.experts == "fp4" and ".experts." in name and is_quantized(quant, name)


def weight_dtype(quant: WeightQuant, name: str) -> str:
    """The dtype quantized weight `name` is held in: float8_e4m3fn, or int8 for FP4."""
    return FP4_DTYPE if is_fp4(quant, name) else WEIGHT_DTYPE


def scale_dtype(quant: WeightQuant) -> str:
    """The dtype a block's scales are held in: float32, or the UE8M0 byte."""
    return E8M0_DTYPE if quant.scale_fmt == "ue8m0" else SCALE_DTYPE


def is_scale(name: str) -> bool:
    """`name` is a quantized weight's scales (`.weight_scale_inv`, or a UE8M0 checkpoint's `.scale`)."""
    return name.endswith((SCALE_SUFFIX, UE8M0_SUFFIX))


def scale_of(weight: str, quant: WeightQuant | None = None) -> str:
    """The scales' name of quantized weight `weight` (`...q_proj.weight` -> `...q_proj.weight_scale_inv`, or
    `.scale` for a UE8M0 `quant`)."""
    suffix = UE8M0_SUFFIX if quant is not None and quant.scale_fmt == "ue8m0" else SCALE_SUFFIX
    return weight.removesuffix(".weight") + suffix


def weight_of(scale: str) -> str:
    """The weight whose scales are `scale`."""
    return scale.removesuffix(SCALE_SUFFIX).removesuffix(UE8M0_SUFFIX) + ".weight"


def block_of(quant: WeightQuant, weight: str) -> tuple[int, int]:
    """(rows, cols) of stored entries one scale of `weight` covers: the checkpoint's block, or for FP4 one row
    of FP4_GROUP inputs, FP4_GROUP / 2 stored bytes."""
    return (1, FP4_GROUP // 2) if is_fp4(quant, weight) else quant.block


def scale_shape(quant: WeightQuant, shape: tuple[int, ...], weight: str = "") -> tuple[int, ...]:
    """The checkpoint scales' shape of weight `weight` of stored `shape` ([..., out, in]): a scale per block,
    edges partial."""
    *lead, rows, cols = shape
    block = block_of(quant, weight)
    return (*lead, -(-rows // block[0]), -(-cols // block[1]))


def scale_grid(quant: WeightQuant, cut: tuple[int, int, int] | None, weight: str = "") -> tuple[int, int]:
    """(rows, cols) of the sub-block each of a rank's scales covers, for a 2-D weight cut to `cut` ((dim, start,
    stop) along dimension 0 or 1, or None: held whole): gcd(block, n) along the cut dimension of n entries, the
    block along the other. The same on every rank."""
    grid = list(block_of(quant, weight))
    if cut is not None:
        grid[cut[0]] = math.gcd(grid[cut[0]], cut[2] - cut[1])
    return grid[0], grid[1]


def scale_cut(quant: WeightQuant, cut: tuple[int, int, int] | None,
              weight: str = "") -> tuple[int, int, int, int] | None:
    """A rank's cut of the checkpoint scales of a 2-D weight cut to `cut`: (dim, start, stop, repeat), entries
    [start, stop) of dimension `dim` of the scales with each entry of that dimension repeated `repeat` times (a
    scale per sub-block of scale_grid: a block's scale for each sub-block inside it); None when held whole.
    start and stop are whole: the rank's share starts at rank x n, a multiple of its sub-block."""
    if cut is None:
        return None
    dim, start, stop = cut
    grid = scale_grid(quant, cut, weight)[dim]
    return dim, start // grid, stop // grid, block_of(quant, weight)[dim] // grid
