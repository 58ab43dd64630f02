"""MiniMax-M2, as MiniMaxM2Config reads a config.json.

Pure: no torch import. Grouped-query attention without biases whose q and k projections are each
RMS-normalised as one vector over all their heads (q_norm, k_norm: weights as wide as the projection) before
the split into heads; a partial rotary (the leading head_dim x partial_rotary_factor dims, from
rope_parameters or the published checkpoints' legacy `rotary_dim`), rope_theta 5e6 by default; a mixture of
experts on every layer (`block_sparse_moe`, experts w1/w3/w2 as Mixtral's) routed by sigmoid scores in float32
plus a per-expert `e_score_correction_bias` for the choice, the top num_experts_per_tok renormalised (DeepSeek's
router with one group and no scaling). A field config.json leaves out takes MiniMaxM2Config's default
(MiniMax-M2's sizes).
"""

from __future__ import annotations

from kiln.core.model.config import ModelConfig
from kiln.core.errors import BadInput
from kiln.core.model.hf_config.common import (COMMON_READ, EXPERTS, GROUPED_ROUTER, PARTIAL_ROTARY, QK_NORM,
                                              QK_NORM_WHOLE, Family, aliased, number, shared_fields, silu)
from kiln.core.model.hf_config.rope import rope_fields

_DEFAULTS = {"vocab_size": 200064, "hidden_size": 3072, "intermediate_size": 1536, "num_hidden_layers": 62,
             "num_attention_heads": 48, "num_key_value_heads": 8, "head_dim": 128}
"""MiniMaxM2Config's defaults for the sizes every family reads."""
_THETA = 5000000.0


def _rotary(raw: dict) -> tuple[dict, int | None]:
    """(config.json without the partial rotary's fields, the rotary dims or None for all of head_dim): from
    partial_rotary_factor (top level or in rope_parameters) or the legacy rotary_dim, which must agree."""
    head_dim = raw["head_dim"]
    params = raw.get("rope_parameters")
    params = dict(params) if isinstance(params, dict) else params
    spelled = {}
    if raw.get("partial_rotary_factor") is not None:
        spelled["partial_rotary_factor"] = number(raw, "partial_rotary_factor", 1.0)
    if isinstance(params, dict) and "partial_rotary_factor" in params:
        spelled["rope_parameters.partial_rotary_factor"] = number(params, "partial_rotary_factor", 1.0)
        params.pop("partial_rotary_factor")
    if raw.get("rotary_dim") is not None:
        spelled["rotary_dim"] = number(raw, "rotary_dim", head_dim) / head_dim
    if len(set(spelled.values())) > 1:
        raise BadInput(f"config.json: {' and '.join(f'{k}={v!r}' for k, v in spelled.items())} disagree (as a "
                       f"fraction of head_dim {head_dim}); keep one.")
    factor = next(iter(spelled.values()), 1.0)
    rotary = int(head_dim * factor)
    if not 0 < factor <= 1 or rotary % 2 or rotary <= 0:
        raise BadInput(f"config.json: the partial rotary ({next(iter(spelled), 'partial_rotary_factor')}) turns "
                       f"{rotary} of head_dim {head_dim}; it must be an even number of dims, at most head_dim.")
    rest = {k: v for k, v in raw.items() if k not in ("partial_rotary_factor", "rotary_dim", "rope_parameters")}
    return {**rest, **({"rope_parameters": params} if params is not None else {})}, (
        None if rotary == head_dim else rotary)


def _minimax_m2(raw: dict) -> ModelConfig:
    raw = {**_DEFAULTS, **{k: v for k, v in raw.items() if v is not None or k not in _DEFAULTS}}
    rest, rotary = _rotary(raw)
    layers = raw["num_hidden_layers"]
    return ModelConfig(**shared_fields(raw, "minimax_m2"), activation=silu(raw), qk_norm=True, qk_norm_whole=True,
                       rotary_dim=rotary, num_experts=aliased(raw, ("num_local_experts", "num_experts"), 256),
                       experts_per_token=raw.get("num_experts_per_tok", 8),
                       moe_intermediate_size=raw["intermediate_size"], norm_topk_prob=True,
                       moe_layers=tuple(range(layers)), router="sigmoid_groups",
                       **rope_fields(rest, "minimax_m2", _THETA))


def _minimax_m2_to_hf(cfg: ModelConfig) -> dict:
    if cfg.moe_layers != tuple(range(cfg.num_layers)) or cfg.moe_intermediate_size != cfg.intermediate_size \
            or (cfg.router, cfg.num_expert_groups, cfg.topk_groups, cfg.routed_scaling_factor) != (
                "sigmoid_groups", 1, 1, 1.0) or not cfg.norm_topk_prob:
        raise BadInput("a minimax_m2 config has experts on every layer, as wide as intermediate_size, chosen by "
                       "corrected sigmoid scores in one group, renormalised and unscaled.")
    if cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias or cfg.sliding_window is not None or not cfg.qk_norm_whole:
        raise BadInput("a minimax_m2 config has no biases and no window, and normalises q and k over all heads.")
    out = {"hidden_act": "silu", "num_local_experts": cfg.num_experts, "num_experts_per_tok": cfg.experts_per_token}
    if cfg.rotary_dim is not None:
        out["partial_rotary_factor"] = cfg.rotary_dim / cfg.head_dim
    return out


MINIMAX_M2 = Family("minimax_m2", COMMON_READ | {"num_local_experts", "num_experts", "num_experts_per_tok",
                                                 "rotary_dim", "partial_rotary_factor"},
                    _minimax_m2, _minimax_m2_to_hf,
                    features=(EXPERTS, QK_NORM, QK_NORM_WHOLE, PARTIAL_ROTARY, GROUPED_ROUTER),
                    required=())
