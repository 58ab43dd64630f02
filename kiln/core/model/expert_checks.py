"""The checks of a mixture of experts' fields of a ModelConfig (kiln.core.model.config): counts, the router, its
groups, the expert layers. Pure.
"""

from __future__ import annotations

from kiln.core.errors import BadInput

ROUTERS = ("softmax", "sigmoid_groups", "sqrtsoftplus", "softmax_groups", "sigmoid_input")
"""How a mixture of experts picks its experts: the top k of a softmax (Mixtral, Qwen), DeepSeek-V3's sigmoid
scores, corrected by a per-expert bias for the choice only, within the best groups of experts, DeepSeek-V4's
sqrt(softplus) scores (a fixed table on its hash layers, the corrected top k on the others), or Mistral 4's
softmax within the best groups (no correction), in the model's dtype, or Llama 4's top k of the logits, each
chosen expert's sigmoid scaling the token it is given (kiln.core.model.llama4_fields)."""


def check_experts(cfg) -> None:
    """BadInput naming the first expert field of `cfg` (a ModelConfig with expert layers) that cannot be."""
    for field in ("num_experts", "experts_per_token", "moe_intermediate_size"):
        value = getattr(cfg, field)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise BadInput(f"config.json: {field} must be a positive integer for a mixture of experts, "
                           f"got {value!r}.")
    if isinstance(cfg.shared_expert_intermediate_size, bool) or not isinstance(
            cfg.shared_expert_intermediate_size, int) or cfg.shared_expert_intermediate_size < 0:
        raise BadInput("config.json: shared_expert_intermediate_size must be an integer >= 0, got "
                       f"{cfg.shared_expert_intermediate_size!r}.")
    if cfg.router not in ROUTERS:
        raise BadInput(f"config.json: router {cfg.router!r} is not supported; Kiln computes "
                       f"{', '.join(ROUTERS)}.")
    for field in ("num_expert_groups", "topk_groups"):
        value = getattr(cfg, field)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise BadInput(f"config.json: {field} must be a positive integer, got {value!r}.")
    if cfg.num_experts % cfg.num_expert_groups or cfg.topk_groups > cfg.num_expert_groups:
        raise BadInput(f"config.json: n_group ({cfg.num_expert_groups}) must divide the "
                       f"{cfg.num_experts} experts, and topk_group ({cfg.topk_groups}) may not exceed it.")
    if cfg.router in ("sigmoid_groups", "softmax_groups") and (
            cfg.num_experts // cfg.num_expert_groups < 2
            or cfg.experts_per_token > cfg.topk_groups * (cfg.num_experts // cfg.num_expert_groups)):
        raise BadInput(f"config.json: a group of {cfg.num_experts // cfg.num_expert_groups} expert(s) "
                       f"(n_group {cfg.num_expert_groups}) must hold at least 2, and topk_group "
                       f"{cfg.topk_groups} groups at least num_experts_per_tok ({cfg.experts_per_token}).")
    if cfg.experts_per_token > cfg.num_experts:
        raise BadInput(f"config.json: num_experts_per_tok ({cfg.experts_per_token}) exceeds the "
                       f"{cfg.num_experts} experts.")
    if list(cfg.moe_layers) != sorted(set(cfg.moe_layers)) or not all(
            isinstance(i, int) and 0 <= i < cfg.num_layers for i in cfg.moe_layers):
        raise BadInput(f"config.json: the mixture-of-experts layers {list(cfg.moe_layers)} must be distinct "
                       f"layer indices below {cfg.num_layers}, in order.")
