"""DeepSeek-V4, as transformers' DeepseekV4Config reads a config.json (its defaults, and the legacy spellings
it folds in), and back. Pure: no torch import.

What the settings compute: kiln.core.model.v4_fields. How they are read:
- layer_types: given, else the legacy per-layer compress_ratios (0 sliding, 4 CSA, 128 HCA), else two HCA
  layers then HCA and CSA alternating; a longer list is cut to num_hidden_layers, as the class cuts it.
- compress_rates: given, else CSA 4 and HCA 128; the legacy compress_rate_csa / compress_rate_hca override.
- mlp_layer_types: given, else the first num_hash_layers (legacy; default 3) hash-routed, then top-k.
- partial_rotary_factor: given, else the legacy qk_rope_head_dim / head_dim, else 64 / 512; the trailing
  head_dim x partial_rotary_factor dims of each head rotate (qk_rope_head_dim, which save_pretrained writes).
- the rope: sliding layers at rope_theta, plain; compressed layers at compress_rope_theta with the flat
  rope_parameters / rope_scaling (yarn, its attention factor 1 unless given), or the nested
  {main, compress} rope_parameters save_pretrained writes.
Published checkpoints (FP8 attention, FP4 experts: quantization_config, expert_dtype) are refused by name.
Values transformers' classes ignore are accepted only as they are: one shared expert of
moe_intermediate_size, renormalised top-k weights, one key=value head, no biases.
"""

from __future__ import annotations

from kiln.core.model.config import ModelConfig
from kiln.core.errors import BadInput
from kiln.core.model.hf_config.common import (COMMON_READ, EXPERTS, GROUPED_ROUTER, LATENT, SHARED_EXPERT, SLIDING, Family,
                                        aliased, number, positive_int, shared_fields, silu)
from kiln.core.model.hf_config.rope import rope_fields, rope_scaling
from kiln.core.model.v4_fields import CSA, HASH_MOE, HCA, SLIDING as SLIDING_KIND, TOPK_MOE, V4Fields

_DEFAULTS = {
    "vocab_size": 129280, "hidden_size": 4096, "moe_intermediate_size": 2048, "num_hidden_layers": 43,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "q_lora_rank": 1024,
    "num_experts_per_tok": 6, "n_routed_experts": 256, "routed_scaling_factor": 1.5, "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6, "swiglu_limit": 10.0,
    "sliding_window": 128, "o_groups": 8, "o_lora_rank": 1024, "index_n_heads": 64, "index_head_dim": 128,
    "index_topk": 512, "rms_norm_eps": 1e-6, "max_position_embeddings": 1048576, "tie_word_embeddings": False,
}
"""What DeepseekV4Config (transformers 5.25) assumes for a field config.json leaves out."""

_FIXED = {"n_shared_experts": 1, "norm_topk_prob": True, "scoring_func": "sqrtsoftplus", "attention_bias": False,
          "mlp_bias": False, "hidden_act": "silu"}
"""Fields with the one value Kiln computes (transformers' V4 classes build one shared expert and renormalise
whatever the first two say, and have no biases)."""

_RATIO_KINDS = {0: SLIDING_KIND, 4: CSA, 128: HCA}
"""The legacy compress_ratios' values, as DeepseekV4Config maps them to layer types."""

_INERT = {
    "num_nextn_predict_layers": "the multi-token-prediction module, used only for speculative decoding",
    "router_aux_loss_coef": "a training loss weight",
}

_V4_READ = {"layer_types", "compress_rates", "compress_ratios", "compress_rate_csa", "compress_rate_hca",
            "mlp_layer_types", "num_hash_layers", "qk_rope_head_dim", "partial_rotary_factor", "compress_rope_theta",
            "hc_mult", "hc_sinkhorn_iters", "hc_eps", "swiglu_limit", "sliding_window", "o_groups", "o_lora_rank",
            "index_n_heads", "index_head_dim", "index_topk", "routed_scaling_factor", "n_routed_experts",
            "num_local_experts", "num_experts_per_tok", "moe_intermediate_size", "q_lora_rank",
            "quantization_config", "expert_dtype", *_FIXED}


def _layer_types(raw: dict, layers: int) -> list[str]:
    if raw.get("layer_types") is not None:
        kinds = raw["layer_types"]
    elif raw.get("compress_ratios") is not None:
        ratios = raw["compress_ratios"]
        bad = [r for r in ratios if r not in _RATIO_KINDS] if isinstance(ratios, list) else [ratios]
        if bad:
            raise BadInput(f"config.json: compress_ratios={ratios!r}: each must be one of {sorted(_RATIO_KINDS)}.")
        kinds = [_RATIO_KINDS[r] for r in ratios]
    else:
        kinds = [HCA] * min(layers, 2) + [CSA if i % 2 else HCA for i in range(max(layers - 2, 0))]
    return _per_layer(kinds, layers, "layer_types")


def _per_layer(kinds, layers: int, name: str) -> list[str]:
    """A per-layer list cut to `layers` entries, as DeepseekV4Config cuts it; fewer is refused."""
    if not isinstance(kinds, list) or len(kinds) < layers:
        raise BadInput(f"config.json: {name}={kinds!r} must name each of the {layers} layers.")
    return kinds[:layers]


def _rates(raw: dict) -> tuple[int, int]:
    rates = raw.get("compress_rates")
    rates = {CSA: 4, HCA: 128} if rates is None else rates
    if not isinstance(rates, dict) or set(rates) != {CSA, HCA}:
        raise BadInput(f"config.json: compress_rates={rates!r} must give a rate for {CSA} and {HCA}.")
    rates = {**rates, **{kind: raw[key] for kind, key in ((CSA, "compress_rate_csa"), (HCA, "compress_rate_hca"))
                         if raw.get(key) is not None}}
    return positive_int(rates, CSA, 0), positive_int(rates, HCA, 0)


def _mlp_types(raw: dict, layers: int) -> list[str]:
    if raw.get("mlp_layer_types") is not None:
        return _per_layer(raw["mlp_layer_types"], layers, "mlp_layer_types")
    hashed = raw.get("num_hash_layers")
    hashed = 3 if hashed is None else hashed
    if isinstance(hashed, bool) or not isinstance(hashed, int) or hashed < 0:
        raise BadInput(f"config.json: num_hash_layers={hashed!r} must be an integer >= 0.")
    return [HASH_MOE] * min(layers, hashed) + [TOPK_MOE] * max(0, layers - hashed)


def _rotated(raw: dict, head_dim: int) -> int:
    """head_dim x partial_rotary_factor: the trailing dims of each head that rotate."""
    factor, legacy = raw.get("partial_rotary_factor"), raw.get("qk_rope_head_dim")
    if factor is None:
        factor = legacy / head_dim if isinstance(legacy, int) and not isinstance(legacy, bool) else 64 / 512
    rotated = int(head_dim * number({"partial_rotary_factor": factor}, "partial_rotary_factor", 0.0))
    if legacy is not None and legacy != rotated:
        raise BadInput(f"config.json: qk_rope_head_dim={legacy!r} and head_dim x partial_rotary_factor "
                       f"({rotated}) disagree; keep one.")
    return rotated


def _ropes(raw: dict, rotated: int, head_dim: int) -> tuple[float, dict]:
    """(the sliding layers' rope_theta, ModelConfig's rope_* fields of the compressed layers' rope)."""
    params = raw.get("rope_parameters")
    if params is not None and raw.get("rope_scaling") is not None:
        raise BadInput("config.json has both rope_parameters (transformers 5) and rope_scaling (4.x); keep one.")
    params = params if params is not None else raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise BadInput(f"config.json: rope_parameters={params!r} must be an object or null.")
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        main, compress = dict(params["main"]), dict(params["compress"])
    else:
        flat = {k: v for k, v in params.items() if k not in ("main", "compress")}
        main = {"rope_type": "default", "rope_theta": raw["rope_theta"]}
        compress = {"rope_type": "default", **flat, "rope_theta": raw["compress_rope_theta"]}
        if compress.get("rope_type", compress.get("type")) == "yarn":
            compress.setdefault("attention_factor", 1.0)
    for label, rope in (("main", main), ("compress", compress)):
        factor = rope.pop("partial_rotary_factor", None)
        if factor is not None and int(head_dim * factor) != rotated:
            raise BadInput(f"config.json: rope_parameters.{label}.partial_rotary_factor={factor!r} does not rotate "
                           f"the {rotated} dims partial_rotary_factor says.")
    if main.get("rope_type", main.get("type", "default")) != "default" or set(main) - {"rope_type", "type",
                                                                                      "rope_theta"}:
        raise BadInput(f"config.json: rope_parameters.main={main!r}: DeepSeek-V4's sliding layers rotate plain "
                       "(rope_type default, a rope_theta); Kiln computes no other.")
    theta = number(main, "rope_theta", 10000.0)
    reading = rope_fields({"rope_parameters": compress, "max_position_embeddings": raw["max_position_embeddings"]},
                          "deepseek_v4")
    if reading["rope_type"] not in ("default", "yarn"):
        raise BadInput(f"config.json: the compressed layers' rope_type {reading['rope_type']!r}: DeepSeek-V4's is "
                       "default or yarn; Kiln computes no other for it.")
    return theta, reading


def _deepseek_v4(raw: dict) -> ModelConfig:
    raw = {**_DEFAULTS, **raw}
    for name, value in _FIXED.items():
        if name in raw and raw[name] != value and not (name == "n_shared_experts" and raw[name] is None):
            raise BadInput(f"config.json: {name}={raw[name]!r}: Kiln computes DeepSeek-V4 as transformers' "
                           f"DeepseekV4ForCausalLM does, with {name}={value!r} only.")
    layers = positive_int(raw, "num_hidden_layers", 0)
    head_dim = positive_int(raw, "head_dim", 0)
    rotated = _rotated(raw, head_dim)
    csa_rate, hca_rate = _rates(raw)
    main_theta, rope = _ropes(raw, rotated, head_dim)
    experts = aliased(raw, ("n_routed_experts", "num_local_experts"), 256)
    width = aliased(raw, ("moe_intermediate_size", "intermediate_size"), 2048)
    v4 = V4Fields(layer_types=_layer_types(raw, layers), mlp_layer_types=_mlp_types(raw, layers), csa_rate=csa_rate,
                  hca_rate=hca_rate, main_rope_theta=main_theta, hc_mult=raw["hc_mult"],
                  hc_sinkhorn_iters=raw["hc_sinkhorn_iters"], hc_eps=raw["hc_eps"], swiglu_limit=raw["swiglu_limit"],
                  o_groups=raw["o_groups"], o_lora_rank=raw["o_lora_rank"], index_n_heads=raw["index_n_heads"],
                  index_head_dim=raw["index_head_dim"], index_topk=raw["index_topk"])
    shared = shared_fields({**raw, "intermediate_size": width}, "deepseek_v4")
    return ModelConfig(**shared, **rope, activation=silu(raw),
                       sliding_window=positive_int(raw, "sliding_window", 0), q_lora_rank=positive_int(
                           raw, "q_lora_rank", 0), qk_rope_head_dim=rotated, rope_interleave=True,
                       num_experts=positive_int({"n_routed_experts": experts}, "n_routed_experts", 0),
                       experts_per_token=positive_int(raw, "num_experts_per_tok", 0), moe_intermediate_size=width,
                       moe_layers=tuple(range(layers)), shared_expert_intermediate_size=width,
                       router="sqrtsoftplus", routed_scaling_factor=number(raw, "routed_scaling_factor", 0.0), v4=v4)


def _deepseek_v4_to_hf(cfg: ModelConfig) -> dict:
    v4 = cfg.v4
    if v4 is None or cfg.router != "sqrtsoftplus" or cfg.shared_expert_intermediate_size != cfg.moe_intermediate_size:
        raise BadInput("a deepseek_v4 config has DeepSeek-V4's own fields (v4), sqrtsoftplus routing and one "
                       "shared expert of moe_intermediate_size.")
    return {"rope_theta": v4.main_rope_theta, "compress_rope_theta": cfg.rope_theta, "rope_scaling": rope_scaling(cfg),
            "head_dim": cfg.head_dim, "q_lora_rank": cfg.q_lora_rank,
            "partial_rotary_factor": cfg.qk_rope_head_dim / cfg.head_dim, "sliding_window": cfg.sliding_window,
            "layer_types": list(v4.layer_types), "mlp_layer_types": list(v4.mlp_layer_types),
            "compress_rates": {CSA: v4.csa_rate, HCA: v4.hca_rate}, "hc_mult": v4.hc_mult,
            "hc_sinkhorn_iters": v4.hc_sinkhorn_iters, "hc_eps": v4.hc_eps, "swiglu_limit": v4.swiglu_limit,
            "o_groups": v4.o_groups, "o_lora_rank": v4.o_lora_rank, "index_n_heads": v4.index_n_heads,
            "index_head_dim": v4.index_head_dim, "index_topk": v4.index_topk, "n_routed_experts": cfg.num_experts,
            "num_experts_per_tok": cfg.experts_per_token, "moe_intermediate_size": cfg.moe_intermediate_size,
            "routed_scaling_factor": cfg.routed_scaling_factor, **_FIXED}


DEEPSEEK_V4 = Family(
    "deepseek_v4", COMMON_READ | _V4_READ, _deepseek_v4, _deepseek_v4_to_hf,
    features=(EXPERTS, SHARED_EXPERT, LATENT, SLIDING, GROUPED_ROUTER), required=(), inert=_INERT)
