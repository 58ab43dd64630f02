"""What each family's checkpoint calls a layer's MLP, its experts, its router and its shared expert. Pure.

kiln.core.model.contract names every tensor from these; the model's layers read them by the same names.
"""

from __future__ import annotations

EXPERTS = {"mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
           "minimax_m2": ("block_sparse_moe", ("w1", "w3", "w2")),
           "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
           "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
           "deepseek_v3": ("mlp", ("gate_proj", "up_proj", "down_proj")),
           "deepseek_v32": ("mlp", ("gate_proj", "up_proj", "down_proj")),
           "glm_moe_dsa": ("mlp", ("gate_proj", "up_proj", "down_proj")),
           "mistral4": ("mlp", ("gate_proj", "up_proj", "down_proj")),
           "llama4_text": ("feed_forward", ("gate_proj", "up_proj", "down_proj"))}
"""model_type -> (the module of a mixture-of-experts layer, its experts' (gate, up, down) projection names), as
published checkpoints name them: `<module>.<router_of(cfg)>` is the router (a sigmoid router's correction bias is
`<module>.<correction_bias(cfg)>`), `<module>.experts.<e>.<proj>.weight` expert e's projections (or, fused,
kiln.core.model.fused_experts)."""

SHARED_EXPERTS = {"qwen2_moe": ("mlp.shared_expert", "mlp.shared_expert_gate"),
                  "deepseek_v3": ("mlp.shared_experts", None), "mistral4": ("mlp.shared_experts", None),
                  "deepseek_v32": ("mlp.shared_experts", None), "glm_moe_dsa": ("mlp.shared_experts", None),
                  "llama4_text": ("feed_forward.shared_expert", None)}
"""model_type -> (the module of the shared expert every token runs, its sigmoid gate's module or None): its
projections are `<module>.{gate,up,down}_proj.weight`, as wide as shared_expert_intermediate_size."""

_MLP = {"llama4_text": "feed_forward"}
"""model_type -> the module of a dense layer's MLP where it is not `mlp`."""
_ROUTER = {"llama4_text": "router.weight"}
"""model_type -> its router's weight within the experts' module where it is not `gate.weight`."""


def correction_bias(cfg) -> str:
    """Where a sigmoid router's e_score_correction_bias sits in its module: under the router (DeepSeek-V3's
    `gate.e_score_correction_bias`) or beside it (MiniMax-M2's `e_score_correction_bias`)."""
    return "e_score_correction_bias" if cfg.architecture == "minimax_m2" else "gate.e_score_correction_bias"


def router_of(cfg) -> str:
    """The router's weight within the experts' module: `gate.weight`, Llama 4's `router.weight`."""
    return _ROUTER.get(cfg.architecture, "gate.weight")


def mlp_module(cfg) -> str:
    """The module of a dense layer's gated MLP: `mlp`, Llama 4's `feed_forward`."""
    return _MLP.get(cfg.architecture, "mlp")


def is_shared_expert(name: str) -> bool:
    """`name` (a checkpoint tensor or a constant's suffix) is a shared expert's projection (DeepSeek-V4's
    `ffn.shared_experts` too)."""
    return any(f"{module}." in name for module in [m for m, _ in SHARED_EXPERTS.values()] + ["ffn.shared_experts"])
