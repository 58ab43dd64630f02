"""Phi-3 and Phi-4, as Phi3Config reads a config.json.

Pure: no torch import. Fused qkv_proj and gate_up_proj (the checkpoint's business, not the config's); no
biases; rms_norm_eps 1e-5 by default; a sliding window on every layer; a partial rotary
(partial_rotary_factor, top level or, as transformers 5 writes it, in rope_parameters). Phi3Config's
longrope (also under its old names su and yarn, which Phi3Config renames) takes the top-level
original_max_position_embeddings (default 4096) before the rope's own, as Phi3Config does.
"""

from __future__ import annotations

from kiln.core.model.config import ModelConfig
from kiln.core.errors import BadInput
from kiln.core.model.hf_config.common import COMMON_READ, PARTIAL_ROTARY, SLIDING, Family, shared_fields, silu
from kiln.core.model.hf_config.rope import rope_fields


def _partial_rotary(raw: dict) -> dict:
    """Phi-3's rope: the common reading, plus partial_rotary_factor (top level, or in rope_parameters as
    transformers 5 writes it): rotary_dim = int(head_dim x factor), head_dim as Phi3Attention takes it."""
    params = raw.get("rope_parameters")
    params = dict(params) if isinstance(params, dict) else params
    spelled = {}
    if "partial_rotary_factor" in raw:
        spelled["partial_rotary_factor"] = raw["partial_rotary_factor"]
    if isinstance(params, dict) and "partial_rotary_factor" in params:
        spelled["rope_parameters.partial_rotary_factor"] = params.pop("partial_rotary_factor")
    if len(set(map(repr, spelled.values()))) > 1:
        raise BadInput(f"config.json: {' and '.join(f'{k}={v!r}' for k, v in spelled.items())} disagree; keep one.")
    rest = {k: v for k, v in raw.items() if k not in ("rope_parameters", "partial_rotary_factor")}
    rope = params if params is not None else raw.get("rope_scaling")
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) in ("su", "yarn"):  # Phi3Config's renaming
        rope = {k: v for k, v in rope.items() if k != "type"} | {"rope_type": "longrope"}
        rest = rest if params is not None else {**rest, "rope_scaling": rope}
        params = rope if params is not None else None
    original = raw.get("original_max_position_embeddings", 4096)
    rest.setdefault("max_position_embeddings", 4096)  # Phi3Config's defaults, for longrope's factor
    out = rope_fields(rest if params is None else {**rest, "rope_parameters": params}, "phi3",
                      original_max_position=original)
    factor = next(iter(spelled.values()), 1.0)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise BadInput(f"config.json: partial_rotary_factor={factor!r} must be a number in (0, 1].")
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    rotary = int(head_dim * factor)
    if rotary % 2 or rotary <= 0:
        raise BadInput(f"config.json: partial_rotary_factor={factor!r} turns {rotary} of head_dim {head_dim}; the "
                       "rotary embedding needs an even number of dims.")
    return {**out, "rotary_dim": None if rotary == head_dim else rotary}


def _phi3(raw: dict) -> ModelConfig:
    return ModelConfig(**shared_fields(raw, "phi3", rms_norm_eps=1e-5), activation=silu(raw),
                       sliding_window=raw.get("sliding_window"), **_partial_rotary(raw))


def _phi3_to_hf(cfg: ModelConfig) -> dict:
    if cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias or cfg.first_sliding_layer:
        raise BadInput("a phi3 config has no biases, and its sliding window covers every layer.")
    out = {"hidden_act": "silu", "sliding_window": cfg.sliding_window}
    if cfg.rope_type == "longrope":  # where Phi3Config reads it first
        out["original_max_position_embeddings"] = cfg.rope_original_max_position
    if cfg.rotary_dim is not None:
        out["partial_rotary_factor"] = cfg.rotary_dim / cfg.head_dim
    return out


PHI3 = Family("phi3", COMMON_READ | {"sliding_window", "partial_rotary_factor", "original_max_position_embeddings"},
              _phi3, _phi3_to_hf, features=(SLIDING, PARTIAL_ROTARY))
