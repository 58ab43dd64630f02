"""What one rank's weights weigh, in bytes, as the gate, the KV plan and the memory sizing count them before any
weight is read: kiln.core.model.param_counts' count of parameters in their formats, or, for the formats too many
to count by hand, the contract's constants (kiln.core.model.contract) each in its own dtype."""

from __future__ import annotations

import functools
import math

from kiln.core.model.config import ModelConfig
from kiln.core.model.contract import constant_dtype, constant_shapes
from kiln.core.model.param_counts import weight_bytes
from kiln.core.model.safetensors_header import DTYPES

_ITEMSIZE = {d.torch_name: d.itemsize_bytes for d in DTYPES.values()}
"""Bytes per entry of each dtype a package constant is held in (safetensors' table, by torch's names)."""


@functools.lru_cache(maxsize=16)  # a few tenths of a second at V4-Flash's size; the plan asks several times
def _held_bytes(cfg: ModelConfig, tp: int) -> int:
    return sum(math.prod(shape) * _ITEMSIZE[constant_dtype(cfg, name)]
               for name, shape in constant_shapes(cfg, tp).items())


def weight_bytes_per_rank(cfg: ModelConfig, tp: int) -> int:
    """Bytes of one rank's weights, what the gate, the KV plan and the memory sizing count on: sharded attention
    and MLP, replicated embeddings and norms; a quantized checkpoint's projections in their own dtype, with their
    scales (kiln.core.model.param_counts.weight_bytes). A quantized DeepSeek-V4's formats (float32, int64,
    float8, FP4 bytes, UE8M0 scales) and gpt-oss's (float32 norms; MXFP4 bytes and scales) are too many to
    count by hand: their constants are summed, each shape in its own dtype, which is exactly what a rank
    binds."""
    if cfg.architecture == "gpt_oss" or cfg.v4 is not None and cfg.quant is not None:
        return _held_bytes(cfg, tp)
    return weight_bytes(cfg, tp, cfg.dtype_bytes)
