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
"""

from __future__ import annotations

GATE_UP, GATE_UP_BIAS = "mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias"
DOWN, DOWN_BIAS = "mlp.experts.down_proj", "mlp.experts.down_proj_bias"
ROUTER, ROUTER_BIAS = "mlp.router.weight", "mlp.router.bias"
SINKS = "self_attn.sinks"


def layer_shapes(cfg, p: str) -> dict[str, tuple[int, ...]]:
    """Layer `p`'s mixture-of-experts tensors (`p`: `model.layers.<i>`), by checkpoint name (its sinks are its
    attention's: kiln.core.model.attention_shapes)."""
    h, e, i = cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size
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
    return None


def owns(name: str) -> bool:
    """`name` (a checkpoint tensor or a stacked constant) is one of gpt-oss's own tensors (layer_shapes)."""
    return f".{name}".endswith(tuple(f".{n}" for n in (SINKS, ROUTER, ROUTER_BIAS, GATE_UP, GATE_UP_BIAS, DOWN,
                                                       DOWN_BIAS)))


def constant_dtype(cfg, name: str) -> str:
    """float32 for the RMSNorms' weights (as transformers keeps them), the model's dtype otherwise."""
    return "float32" if name.endswith("norm.weight") else cfg.dtype


def params(cfg, heads: int, columns: int) -> int:
    """What gpt-oss holds per layer beyond a mixture of experts of `columns` columns per expert (kiln.core.model.
    param_counts counts its projections and router rows): the sinks of its `heads`, the router's bias and the
    experts' biases."""
    return heads + cfg.num_experts * (1 + 2 * columns + cfg.hidden_size)
