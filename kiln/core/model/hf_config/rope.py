"""The rotary embedding's fields of a config.json, both spellings, and back.

Pure: no torch import. transformers 4.x writes a top-level `rope_theta` and `rope_scaling`; transformers 5
writes `rope_parameters` (theta inside). Rope types default, linear, llama3, yarn, longrope and dynamic are
read as transformers' modeling_rope_utils computes them (the last two go by the sequence's length, which a
forward of such a model takes as an input).
"""

from __future__ import annotations

import math

from kiln.core.model.config import ModelConfig
from kiln.core.errors import BadInput
from kiln.core.model.hf_config.common import number

ROPE_KEYS = {
    "default": {"rope_type", "rope_theta"},
    "linear": {"rope_type", "rope_theta", "factor"},
    "llama3": {"rope_type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"},
    "yarn": {"rope_type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "mscale", "mscale_all_dim", "attention_factor", "truncate"},
    "longrope": {"rope_type", "rope_theta", "short_factor", "long_factor", "factor", "attention_factor",
                 "original_max_position_embeddings"},
    "dynamic": {"rope_type", "rope_theta", "factor"},
}
"""Rope types Kiln computes, and the keys each may hold."""
PER_LAYER_TYPE = {"full_attention", "sliding_attention"}
"""The keys of transformers 5's rope_parameters when each layer type has a rope of its own (Gemma 3)."""


def rope_fields(raw: dict, family: str, default_theta: float = 10000.0,
                original_max_position: int | None = None) -> dict:
    """ModelConfig's rope_* keyword arguments from either spelling; `default_theta` when no rope_theta is given.
    A rope per layer type is refused (Gemma 3 splits it before it calls this). `original_max_position`: a
    family's own top-level original_max_position_embeddings, which transformers puts before the rope's (Phi-3)."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params and set(params) <= PER_LAYER_TYPE:
        raise BadInput(f"config.json: rope_parameters per layer type ({', '.join(params)}) are Gemma 3's; "
                       f"a {family} model has one rope for every layer.")
    scaling = raw.get("rope_scaling")
    if params is not None and scaling is not None:
        raise BadInput("config.json has both rope_parameters (transformers 5) and rope_scaling (4.x); keep one.")
    where = "rope_parameters" if params is not None else "rope_scaling"
    rope = params if params is not None else scaling or {}
    if not isinstance(rope, dict):
        raise BadInput(f"config.json: {where}={rope!r} must be an object or null.")
    rope = dict(rope)
    if "type" in rope:  # the older spelling of rope_type; transformers 5 keeps both when it reads a 4.x file
        older = rope.pop("type")
        if rope.setdefault("rope_type", older) != older:
            raise BadInput(f"config.json: {where}.type={older!r} and {where}.rope_type={rope['rope_type']!r} "
                           "disagree; keep one.")
    kind = rope.get("rope_type", "default")
    if kind not in ROPE_KEYS:
        raise BadInput(f"config.json: {where}.rope_type={kind!r} is not supported; Kiln computes rope types "
                       f"{', '.join(ROPE_KEYS)} (a model with {kind!r} would be computed wrongly).")
    extra = sorted(set(rope) - ROPE_KEYS[kind])
    if extra:
        raise BadInput(f"config.json: {where}.{extra[0]}={rope[extra[0]]!r} is not understood for rope type "
                       f"{kind!r}; Kiln reads {', '.join(sorted(ROPE_KEYS[kind]))}.")
    theta = rope.get("rope_theta", raw.get("rope_theta", default_theta))
    if "rope_theta" in rope and "rope_theta" in raw and rope["rope_theta"] != raw["rope_theta"]:
        raise BadInput(f"config.json: rope_theta={raw['rope_theta']!r} and {where}.rope_theta="
                       f"{rope['rope_theta']!r} disagree; keep one.")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise BadInput(f"config.json: rope_theta={theta!r} must be a number.")
    out = {"rope_type": kind, "rope_theta": float(theta)}
    if kind == "yarn":
        return {**out, **_yarn(rope, raw, where)}
    if kind == "longrope":
        if family != "phi3":
            raise BadInput(f"config.json: {where}.rope_type='longrope' is computed for Phi-3 only: only its "
                           "transformers class rebuilds the cache when a sequence passes the original context, "
                           f"and a {family} model would mix keys of both factors.")
        if original_max_position is not None:
            rope["original_max_position_embeddings"] = original_max_position
        return {**out, **_longrope(rope, raw, where)}
    if kind == "dynamic":
        return {**out, "rope_factor": number(rope, "factor", 1.0), "rope_max_position": _positions(raw, where)}
    if kind in ("linear", "llama3"):
        if "factor" not in rope:
            raise BadInput(f"config.json: {where} of type {kind!r} lacks factor.")
        out["rope_factor"] = number(rope, "factor", 1.0)
    if kind == "llama3":
        for key, field in (("low_freq_factor", "rope_low_freq_factor"), ("high_freq_factor", "rope_high_freq_factor"),
                           ("original_max_position_embeddings", "rope_original_max_position")):
            if key not in rope:
                raise BadInput(f"config.json: {where} of type 'llama3' lacks {key}.")
            out[field] = rope[key] if key.startswith("original") else number(rope, key, 1.0)
    return out


def _positions(raw: dict, where: str, key: str = "max_position_embeddings") -> int:
    value = raw.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise BadInput(f"config.json: {where}'s rope type needs {key} as a positive integer, got {value!r}.")
    return value


def _longrope(rope: dict, raw: dict, where: str) -> dict:
    """longrope's fields as transformers' _compute_longrope_parameters reads them: the two factor lists, the
    original context (the rope's, else max_position_embeddings), a null factor as the two contexts' ratio,
    and the attention factor (cos and sin are multiplied by it), when not given, sqrt(1 + ln(factor) /
    ln(original context)) above a factor of 1."""
    for key in ("short_factor", "long_factor"):
        if not isinstance(rope.get(key), list):
            raise BadInput(f"config.json: {where} of type 'longrope' needs {key} as a list of numbers, got "
                           f"{rope.get(key)!r}.")
    old_len = rope.get("original_max_position_embeddings") or _positions(raw, where)
    if isinstance(old_len, bool) or not isinstance(old_len, int) or old_len <= 0:
        raise BadInput(f"config.json: {where}.original_max_position_embeddings={old_len!r} must be a positive integer.")
    attention = rope.get("attention_factor")
    if attention is None:  # the factor is only read for it
        factor = rope.get("factor")
        factor = _positions(raw, where) / old_len if factor is None else number(rope, "factor", 1.0)
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(old_len))
    return {"rope_short_factor": tuple(rope["short_factor"]), "rope_long_factor": tuple(rope["long_factor"]),
            "rope_original_max_position": old_len,
            "rope_attention_factor": number({"attention_factor": attention}, "attention_factor", 1.0)}


def get_mscale(scale: float, mscale: float = 1.0) -> float:
    """yarn's magnitude scale (transformers' get_mscale / yarn_get_mscale): 0.1 mscale ln(scale) + 1 above 1."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: dict, raw: dict, where: str) -> dict:
    """yarn's fields as transformers' _compute_yarn_parameters reads them: the original context defaults to
    max_position_embeddings, a null factor to their ratio, beta_fast / beta_slow to 32 / 1, and the attention
    factor (cos and sin are multiplied by it), when not given, to get_mscale(factor, mscale) /
    get_mscale(factor, mscale_all_dim) with both mscales, else get_mscale(factor)."""
    if "factor" not in rope:
        raise BadInput(f"config.json: {where} of type 'yarn' lacks factor.")
    old_len = rope.get("original_max_position_embeddings", raw.get("max_position_embeddings"))
    if isinstance(old_len, bool) or not isinstance(old_len, int) or old_len <= 0:
        raise BadInput(f"config.json: {where} of type 'yarn' needs original_max_position_embeddings (or "
                       f"max_position_embeddings) as a positive integer, got {old_len!r}.")
    factor = rope["factor"]
    if factor is None:
        factor = number(raw, "max_position_embeddings", 0) / old_len
    factor = number({"factor": factor}, "factor", 1.0)
    if not factor > 0:
        raise BadInput(f"config.json: {where}.factor={factor!r} must be positive.")
    attention = rope.get("attention_factor")
    if attention is None:
        mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and all_dim:
            attention = (get_mscale(factor, number(rope, "mscale", 1.0))
                         / get_mscale(factor, number(rope, "mscale_all_dim", 1.0)))
        else:
            attention = get_mscale(factor)
    truncate = rope.get("truncate", True)
    if not isinstance(truncate, bool):
        raise BadInput(f"config.json: {where}.truncate={truncate!r} must be true or false.")
    return {"rope_factor": factor, "rope_original_max_position": old_len,
            "rope_beta_fast": number(rope, "beta_fast", 32.0) if rope.get("beta_fast") else 32.0,
            "rope_beta_slow": number(rope, "beta_slow", 1.0) if rope.get("beta_slow") else 1.0,
            "rope_truncate": truncate, "rope_attention_factor": number({"attention_factor": attention},
                                                                       "attention_factor", 1.0)}


def rope_scaling(cfg: ModelConfig) -> dict | None:
    """The rope_scaling (transformers 4.x spelling) of `cfg`; None for the default rope. A dynamic rope's
    threshold is the top-level max_position_embeddings (rope_positions)."""
    if cfg.rope_attention_factor != 1.0 and cfg.rope_type not in ("yarn", "longrope"):
        raise BadInput("a rotary attention factor is yarn's and longrope's.")
    if cfg.rope_type == "longrope":
        return {"rope_type": "longrope", "short_factor": list(cfg.rope_short_factor),
                "long_factor": list(cfg.rope_long_factor),
                "original_max_position_embeddings": cfg.rope_original_max_position,
                "attention_factor": cfg.rope_attention_factor}
    if cfg.rope_type == "dynamic":
        return {"rope_type": "dynamic", "factor": cfg.rope_factor}
    if cfg.rope_type == "linear":
        return {"rope_type": "linear", "factor": cfg.rope_factor}
    if cfg.rope_type == "yarn":
        return {"rope_type": "yarn", "factor": cfg.rope_factor,
                "original_max_position_embeddings": cfg.rope_original_max_position,
                "beta_fast": cfg.rope_beta_fast, "beta_slow": cfg.rope_beta_slow,
                "truncate": cfg.rope_truncate, "attention_factor": cfg.rope_attention_factor}
    if cfg.rope_type == "llama3":
        return {"rope_type": "llama3", "factor": cfg.rope_factor, "low_freq_factor": cfg.rope_low_freq_factor,
                "high_freq_factor": cfg.rope_high_freq_factor,
                "original_max_position_embeddings": cfg.rope_original_max_position}
    return None


def rope_positions(cfg: ModelConfig) -> dict:
    """The top-level max_position_embeddings a dynamic rope goes by; nothing for the other rope types."""
    return {"max_position_embeddings": cfg.rope_max_position} if cfg.rope_type == "dynamic" else {}
