"""gpt-oss's own tensors: their checkpoint names and shapes, how a rank cuts them, the dtypes they keep. Pure.

A gpt-oss checkpoint (transformers' GptOssForCausalLM, `save_pretrained`) holds each layer's experts as four
stacked tensors, not one tensor per expert: `mlp.experts.gate_up_proj` [experts, hidden, 2 x intermediate]
(input-major; gate and up columns interleaved: gate j is column 2j, up j column 2j + 1),
`mlp.experts.gate_up_proj_bias` [experts, 2 x intermediate], `mlp.experts.down_proj` [experts, intermediate,
hidden] and `mlp.experts.down_proj_bias` [experts, hidden]; its router is `mlp.router.weight` [experts,
hidden] with `mlp.router.bias` [experts]; each attention layer adds `self_attn.sinks` [heads].

A rank's share of the intermediate columns (kiln.core.model.shares: Share.experts = [s, e)) is contiguous in
the interleaved tensor: columns [2s, 2e) of gate_up_proj and its bias, rows [s, e) of down_proj. The down
projection's bias is every rank's, added once after the sum over the ranks; the router is every rank's; the
sinks follow the query heads. transformers keeps the RMSNorms' weights in float32 in any dtype
(GptOssPreTrainedModel._keep_in_fp32_modules), and so does the package.

gpt-oss as published (quantization_config mxfp4, kiln.core.model.quant.MXFP4) holds its experts' projections as
MXFP4 instead, output-major: `mlp.experts.gate_up_proj_blocks` uint8 [experts, 2 x intermediate, hidden / 32,
16] (32 e2m1 codes per 16 bytes, the even input in the low nibble) beside `mlp.experts.gate_up_proj_scales`
uint8 [experts, 2 x intermediate, hidden / 32] (each group's power of two, exponent + 127), and the same for
`down_proj` over [experts, hidden, intermediate / 32, 16]; transformers dequantizes them and transposes them to
the input-major tensors above (integrations/mxfp4.convert_moe_packed_tensors). A rank keeps the bytes and
scales (uint8) and the graph dequantizes them (kiln.host.model.layers.oss_experts). Its cut: gate/up rows
[2s, 2e), down groups [s / 32, e / 32) (kiln.core.model.shares splits these experts by whole groups of 32).
"""

from __future__ import annotations

GATE_UP, GATE_UP_BIAS = "mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias"
DOWN, DOWN_BIAS = "mlp.experts.down_proj", "mlp.experts.down_proj_bias"
ROUTER, ROUTER_BIAS = "mlp.router.weight", "mlp.router.bias"
SINKS = "self_attn.sinks"
GATE_UP_BLOCKS, GATE_UP_SCALES = "mlp.experts.gate_up_proj_blocks", "mlp.experts.gate_up_proj_scales"
DOWN_BLOCKS, DOWN_SCALES = "mlp.experts.down_proj_blocks", "mlp.experts.down_proj_scales"
GROUP, GROUP_BYTES = 32, 16
"""MXFP4: inputs per scale, and the bytes that hold them."""
_MXFP4 = (GATE_UP_BLOCKS, GATE_UP_SCALES, DOWN_BLOCKS, DOWN_SCALES)
_OWN = (SINKS, "mlp.router.weight", "mlp.router.bias", "mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias",
        "mlp.experts.down_proj", "mlp.experts.down_proj_bias", *_MXFP4)


def mxfp4(cfg) -> bool:
    """`cfg`'s experts are MXFP4 (gpt-oss as published)."""
    return cfg.quant is not None and cfg.quant.method == "mxfp4"


def layer_shapes(cfg, p: str) -> dict[str, tuple[int, ...]]:
    """Layer `p`'s mixture-of-experts tensors (`p`: `model.layers.<i>`), by checkpoint name (its sinks are its
    attention's: kiln.core.model.attention_shapes)."""
    h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
    if mxfp4(cfg):
        return {f"{p}.{ROUTER}": (e, h), f"{p}.{ROUTER_BIAS}": (e,),
                f"{p}.{GATE_UP_BLOCKS}": (e, 2 * i, h // GROUP, GROUP_BYTES),
                f"{p}.{GATE_UP_SCALES}": (e, 2 * i, h // GROUP),
                f"{p}.{GATE_UP_BIAS}": (e, 2 * i), f"{p}.{DOWN_BLOCKS}": (e, h, i // GROUP, GROUP_BYTES),
                f"{p}.{DOWN_SCALES}": (e, h, i // GROUP), f"{p}.{DOWN_BIAS}": (e, h)}
    return {f"{p}.{ROUTER}": (e, h), f"{p}.{ROUTER_BIAS}": (e,),
            f"{p}.{GATE_UP}": (e, h, 2 * i), f"{p}.{GATE_UP_BIAS}": (e, 2 * i), f"{p}.{DOWN}": (e, i, h),
            f"{p}.{DOWN_BIAS}": (e, h)}


def shard_slice(name: str, share) -> tuple[int, int, int] | None:
    """(dim, start, stop) of gpt-oss tensor `name` that a rank of `share` (kiln.core.model.shares.Share) holds;
    None for a tensor that is not gpt-oss's own or that every rank holds whole."""
    s, e = share.experts
    if f".{name}".endswith(f".{SINKS}"):
        return 0, *share.heads
    if f".{name}".endswith(f".{GATE_UP}"):
        return 2, 2 * s, 2 * e
    if f".{name}".endswith(f".{GATE_UP_BIAS}"):
        return 1, 2 * s, 2 * e
    if f".{name}".endswith(f".{DOWN}"):
        return 1, s, e
    if f".{name}".endswith((f".{GATE_UP_BLOCKS}", f".{GATE_UP_SCALES}")):
        return 1, 2 * s, 2 * e
    if f".{name}".endswith((f".{DOWN_BLOCKS}", f".{DOWN_SCALES}")):
        return 2, s // GROUP, e // GROUP
    return None


def owns(name: str) -> bool:
    """`name` (a checkpoint tensor or a stacked constant) is one of gpt-oss's own tensors (layer_shapes)."""
    return f".{name}".endswith(tuple(f".{n}" for n in _OWN))


def constant_dtype(cfg, name: str) -> str:
    """float32 for the RMSNorms' weights (as transformers keeps them), uint8 for MXFP4 blocks and scales, the
    model's dtype otherwise."""
    if name.endswith(_MXFP4):
        return "uint8"
    return "float32" if name.endswith("norm.weight") else cfg.dtype


def params(cfg, heads: int, columns: int) -> int:
    """What gpt-oss holds per layer beyond a mixture of experts of `columns` columns per expert (kiln.core.model.
    param_counts counts its projections and router rows): the sinks of its `heads`, the router's bias and the
    experts' biases; MXFP4 projections count their stored entries (a byte for two inputs, one per 32 for the
    scales) instead of one a weight."""
    out = heads + cfg.num_experts * (1 + 2 * columns + cfg.hidden_size)
    if mxfp4(cfg):
        weights = 3 * cfg.hidden_size * columns
        out += cfg.num_experts * (weights // 2 + weights // GROUP - weights)
    return out
