"""Experts stored as transformers 5 holds them: one 3-D tensor per projection kind and layer. Pure.

A Mistral 4 checkpoint (transformers' Mistral4ForCausalLM, `save_pretrained`: no conversion splits them) holds a
layer's experts as `mlp.experts.gate_up_proj` [experts, 2 x intermediate, hidden] (output-major; each expert's
gate rows, then its up rows) and `mlp.experts.down_proj` [experts, hidden, intermediate]. The module reads
them as the per-expert layout's three projections, each [experts, ...] (kiln.core.model.contract's module
tensors `mlp.experts.{gate,up,down}_proj.weight`): gate is rows [0, I) of gate_up_proj along dimension 1, up
rows [I, 2I), down the whole down_proj. A rank's share [s, e) of the intermediate columns (Share.experts) is
gate rows [s, e), up rows [I + s, I + e) and down columns [s, e) along dimension 2; the package's constant of a
run stacks its layers' cuts, [layers, experts, ...].

A Llama 4 checkpoint (Llama4TextExperts) holds them input-major, as its batched matrix multiplies read them:
`feed_forward.experts.gate_up_proj` [experts, hidden, 2 x intermediate] (gate's columns, then up's) and
`feed_forward.experts.down_proj` [experts, intermediate, hidden]. The module reads them so too (INPUT_MAJOR:
gate and up [experts, hidden, intermediate], columns [0, I) and [I, 2I) along dimension 2; down whole), and a
rank's share is gate columns [s, e), up columns [I + s, I + e) and down rows [s, e) along dimension 1.
"""

from __future__ import annotations

FUSED_EXPERTS = {"mistral4": "mlp", "llama4_text": "feed_forward"}
"""model_type -> the module of its mixture-of-experts layers, whose experts are fused 3-D tensors."""
INPUT_MAJOR = ("llama4_text",)
"""Families whose fused experts are [experts, inputs, outputs] (the others: [experts, outputs, inputs])."""
GATE_UP, DOWN = "experts.gate_up_proj", "experts.down_proj"


def fused(cfg) -> bool:
    """`cfg`'s checkpoint holds its experts fused (FUSED_EXPERTS)."""
    return cfg.architecture in FUSED_EXPERTS


def input_major(cfg) -> bool:
    """`cfg`'s fused experts are [experts, inputs, outputs] (INPUT_MAJOR)."""
    return cfg.architecture in INPUT_MAJOR


def layer_shapes(cfg, p: str) -> dict[str, tuple[int, ...]]:
    """Layer `p`'s experts as the module reads them (`p`: `model.layers.<i>`): three [experts, ...] projections."""
    e, h, i, module = cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, FUSED_EXPERTS[cfg.architecture]
    if input_major(cfg):
        return {f"{p}.{module}.experts.gate_proj.weight": (e, h, i), f"{p}.{module}.experts.up_proj.weight": (e, h, i),
                f"{p}.{module}.experts.down_proj.weight": (e, i, h)}
    return {f"{p}.{module}.experts.gate_proj.weight": (e, i, h), f"{p}.{module}.experts.up_proj.weight": (e, i, h),
            f"{p}.{module}.experts.down_proj.weight": (e, h, i)}


def source(cfg, name: str) -> tuple[str, int, int] | None:
    """(the checkpoint tensor holding module tensor `name`, the dimension it is fused along, where it starts
    there), or None for a tensor that is not a fused expert projection."""
    module = FUSED_EXPERTS.get(cfg.architecture)
    if module is None or f".{module}.experts." not in name or name.split(".experts.", 1)[1][:1].isdigit():
        return None
    layer = name.split(f".{module}.experts.", 1)[0]
    along = 2 if input_major(cfg) else 1  # gate_up's outputs; down's inputs along the other
    if name.endswith("experts.gate_proj.weight"):
        return f"{layer}.{module}.{GATE_UP}", along, 0
    if name.endswith("experts.up_proj.weight"):
        return f"{layer}.{module}.{GATE_UP}", along, cfg.moe_intermediate_size
    return f"{layer}.{module}.{DOWN}", 3 - along, 0
