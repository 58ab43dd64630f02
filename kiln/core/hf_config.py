"""Hugging Face `config.json` -> ModelConfig, by an allow-list.

Pure: no torch import. Every field of a config.json is one of:
- read: mapped onto a ModelConfig field (and so into every forward key);
- checked: accepted only with the value Kiln computes (`hidden_act: silu`);
- inert: does not change what one forward step computes (token ids, the
  initializer, dropout, which is off at inference, ...);
and any other field is bad input, named with its value, before anything
starts. So a field Kiln does not know can never be silently ignored.

Both spellings are read: transformers 4.x (top-level `rope_theta`,
`rope_scaling`, `torch_dtype`) and transformers 5 (`rope_parameters`,
`dtype`). Rope types default, linear, llama3 and yarn (every family but
Phi-3). Supported families: Llama 2/3/3.1/3.2 (tied embeddings;
attention_bias, mlp_bias), Mistral (sliding window),
Qwen2 (q/k/v biases; sliding window from max_window_layers or layer_types)
Qwen3 (per-head q/k RMSNorm, attention_bias, head_dim 128 unless given,
Qwen2's sliding window), Mixtral (top-k of num_local_experts, renormalised;
Mistral's sliding window) and Qwen3-MoE (Qwen3's attention; norm_topk_prob,
decoder_sparse_step, mlp_only_layers; a sliding window on every layer),
Qwen2-MoE (Qwen2's attention and sliding window; Qwen3-MoE's routing, plus a
shared expert on every expert layer, weighted by a sigmoid gate),
Gemma 2 (GeGLU, (1 + weight) norms around attention and MLP, scaled embeddings,
query_pre_attn_scalar, soft-capped scores and logits, sliding and full layers
interleaved) and Gemma 3 (Gemma 2's layers with Gemma's q/k norms and a rotary
base of their own on sliding layers), Phi-3 (fused qkv_proj and gate_up_proj;
partial_rotary_factor; a sliding window on every layer; longrope refused).
"""

from __future__ import annotations

import math

from kiln.core.config import ARCHITECTURES, ModelConfig
from kiln.core.errors import BadInput

_COMMON = {"architectures", "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
           "num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps", "hidden_act", "rope_theta",
           "rope_scaling", "rope_parameters", "dtype", "torch_dtype", "tie_word_embeddings"}
READ = {
    "llama": _COMMON | {"attention_bias", "mlp_bias"},
    "mistral": _COMMON | {"sliding_window"},
    "qwen2": _COMMON | {"use_sliding_window", "sliding_window", "max_window_layers", "layer_types"},
    "qwen3": _COMMON | {"attention_bias", "use_sliding_window", "sliding_window", "max_window_layers", "layer_types"},
    "mixtral": _COMMON | {"sliding_window", "num_local_experts", "num_experts", "num_experts_per_tok"},
    "qwen3_moe": _COMMON | {"attention_bias", "use_sliding_window", "sliding_window", "max_window_layers",
                            "num_local_experts", "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                            "norm_topk_prob", "decoder_sparse_step", "mlp_only_layers"},
    "qwen2_moe": _COMMON | {"qkv_bias", "use_sliding_window", "sliding_window", "max_window_layers", "layer_types",
                            "num_experts", "num_experts_per_tok", "moe_intermediate_size",
                            "shared_expert_intermediate_size", "norm_topk_prob", "decoder_sparse_step",
                            "mlp_only_layers"},
    "gemma2": _COMMON | {"hidden_activation", "attention_bias", "query_pre_attn_scalar", "sliding_window",
                         "layer_types", "final_logit_softcapping", "attn_logit_softcapping",
                         "use_bidirectional_attention"},
}
"""Fields each family's config may hold that change the math; Kiln reads every one of them."""
READ["gemma3_text"] = READ["gemma2"] | {"rope_local_base_freq", "sliding_window_pattern", "_sliding_window_pattern"}
READ["phi3"] = _COMMON | {"sliding_window", "partial_rotary_factor", "original_max_position_embeddings"}
"""Phi-3's original_max_position_embeddings only matters to its longrope scaling, which Kiln refuses."""
GEMMA = ("gemma2", "gemma3_text")

_GEMMA_DEFAULTS = {
    "gemma2": {"head_dim": 256, "query_pre_attn_scalar": 256, "final_logit_softcapping": 30.0,
               "attn_logit_softcapping": 50.0, "sliding_window": 4096, "pattern": 2},
    "gemma3_text": {"head_dim": 256, "query_pre_attn_scalar": 256, "final_logit_softcapping": None,
                    "attn_logit_softcapping": None, "sliding_window": 4096, "pattern": 6, "rope_theta": 1000000.0,
                    "rope_local_base_freq": 10000.0},
}
"""What Gemma2Config and Gemma3TextConfig assume for a field config.json leaves out (a full layer every
`pattern` layers, the others sliding)."""

INERT = {
    "transformers_version": "the library that wrote the file",
    "_name_or_path": "where the file came from",
    "bos_token_id": "a tokenizer id", "eos_token_id": "a tokenizer id", "pad_token_id": "a tokenizer id",
    "use_cache": "a generate() setting", "initializer_range": "how random weights are drawn",
    "max_position_embeddings": "a documented limit; Kiln's own limit is the recipe's max_context_tokens",
    "attention_dropout": "dropout is off at inference", "pretraining_tp": "splits the same matmuls (same math)",
    "output_attentions": "a generate() setting", "output_hidden_states": "a generate() setting",
    "return_dict": "a generate() setting", "tokenizer_class": "a tokenizer setting",
    "output_router_logits": "a training output (the router's logits for the auxiliary loss)",
    "router_aux_loss_coef": "a training loss weight", "router_jitter_noise": "noise applied in training only",
    "cache_implementation": "a generate() setting (which cache class it builds)",
    "resid_pdrop": "dropout is off at inference", "embd_pdrop": "dropout is off at inference",
}
"""Fields that do not change what a forward step computes, with why."""

_ROPE_KEYS = {
    "default": {"rope_type", "rope_theta"},
    "linear": {"rope_type", "rope_theta", "factor"},
    "llama3": {"rope_type", "rope_theta", "factor", "low_freq_factor", "high_freq_factor",
               "original_max_position_embeddings"},
    "yarn": {"rope_type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
             "mscale", "mscale_all_dim", "attention_factor", "truncate"},
}
_SEQUENCE_DEPENDENT = {
    "dynamic": "it rescales the frequencies whenever a sequence grows past max_position_embeddings",
    "longrope": "it switches from its short to its long factors once a sequence passes "
                "original_max_position_embeddings",
}
"""Rope types Kiln refuses, and why: transformers decides them by the current sequence's length, which a
compiled step cannot tell (it holds padded positions past the sequence's end)."""
_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "fp32": "float32",
           "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}


def from_hf(raw: dict) -> ModelConfig:
    """The ModelConfig of a Hugging Face `config.json` dict; BadInput naming any field Kiln does not compute."""
    if not isinstance(raw, dict):
        raise BadInput("config.json must hold a JSON object.")
    family = _family(raw)
    unknown = sorted(set(raw) - READ[family] - set(INERT))
    if unknown:
        shown = ", ".join(f"{k}={raw[k]!r}" for k in unknown[:4])
        raise BadInput(f"config.json: {shown}: Kiln does not compute what {'this field changes' if len(unknown) == 1 else 'these fields change'} "
                       f"for a {family} model, so it cannot export it faithfully (supported fields are listed in "
                       "the README's 'Supported models').")
    missing = [k for k in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                           "intermediate_size") if k not in raw]
    if missing:
        raise BadInput(f"config.json lacks {', '.join(missing)}; it must describe a decoder of a supported family.")
    gemma = family in GEMMA
    activation = _activation(raw, family)
    heads, hidden = raw["num_attention_heads"], raw["hidden_size"]
    # Qwen3Config's head_dim defaults to 128 and Gemma's to 256, not hidden_size / heads as the others' do.
    head_dim = raw.get("head_dim") or ({"qwen3": 128, "gemma2": 256, "gemma3_text": 256}.get(family)
                                       or (hidden // heads if isinstance(hidden, int) and isinstance(heads, int)
                                           and heads else 0))
    bias = _flag(raw, "attention_bias")
    window, first_sliding, full_layers = _sliding(raw, family)
    moe = _experts(raw, family)
    extra = _gemma(raw, family) if gemma else {}
    tied = _flag(raw, "tie_word_embeddings") if "tie_word_embeddings" in raw or not gemma else True
    return ModelConfig(
        architecture=family,
        vocab_size=raw["vocab_size"], hidden_size=hidden, num_layers=raw["num_hidden_layers"],
        num_heads=heads, num_kv_heads=raw.get("num_key_value_heads") or heads, head_dim=head_dim,
        intermediate_size=raw["intermediate_size"],
        rms_norm_eps=_number(raw, "rms_norm_eps", 1e-5 if family == "phi3" else 1e-6),  # each family's default
        dtype=_dtype(raw),
        qkv_bias=bias or family == "qwen2" or (family == "qwen2_moe" and _flag(raw, "qkv_bias", True)),
        o_bias=bias, mlp_bias=_flag(raw, "mlp_bias"),
        qk_norm=family in ("qwen3", "qwen3_moe", "gemma3_text"),
        tie_word_embeddings=tied,
        sliding_window=window, first_sliding_layer=first_sliding, full_attention_layers=full_layers,
        activation=activation, **moe, **extra,
        **(_partial_rotary(raw) if family == "phi3" else _rope(raw, family)),
    )


def _activation(raw: dict, family: str) -> str:
    """The gated MLP's activation: silu for the Llama kin, gelu_pytorch_tanh (GeGLU) for Gemma."""
    if family not in GEMMA:
        if raw.get("hidden_act", "silu") != "silu":
            raise BadInput(f"config.json: hidden_act={raw['hidden_act']!r}: Kiln computes the SwiGLU MLP with silu only.")
        return "silu"
    spelled = {k: raw[k] for k in ("hidden_activation", "hidden_act") if raw.get(k) is not None}
    if len(set(spelled.values())) > 1:
        raise BadInput(f"config.json: hidden_activation={raw['hidden_activation']!r} and hidden_act="
                       f"{raw['hidden_act']!r} disagree; keep one.")
    value = next(iter(spelled.values()), "gelu_pytorch_tanh")
    if value != "gelu_pytorch_tanh":
        raise BadInput(f"config.json: {next(iter(spelled))}={value!r}: Kiln computes Gemma's MLP with "
                       "gelu_pytorch_tanh only.")
    return "gelu_tanh"


def _gemma(raw: dict, family: str) -> dict:
    """ModelConfig's Gemma fields: norms, embedding scale, attention scale and soft caps."""
    defaults = _GEMMA_DEFAULTS[family]
    if raw.get("use_bidirectional_attention"):
        raise BadInput("config.json: use_bidirectional_attention=true: Kiln computes causal decoders only.")
    out = {"norm_unit_offset": True, "sandwich_norms": True, "embed_scale": True}
    for key, field in (("query_pre_attn_scalar", "query_pre_attn_scalar"), ("attn_logit_softcapping", "attn_softcap"),
                       ("final_logit_softcapping", "final_softcap")):
        value = raw.get(key, defaults[key])
        if value is not None:
            value = _number(raw, key, defaults[key])
            if not value > 0:
                raise BadInput(f"config.json: {key}={value!r} must be positive or null.")
        out[field] = value
    return out


_EXPERT_DEFAULTS = {"mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2},
                    "qwen2_moe": {"num_local_experts": 60, "num_experts_per_tok": 4, "moe_intermediate_size": 1408,
                                  "norm_topk_prob": False, "decoder_sparse_step": 1,
                                  "shared_expert_intermediate_size": 5632},
                    "qwen3_moe": {"num_local_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                                  "norm_topk_prob": False, "decoder_sparse_step": 1}}
"""What MixtralConfig, Qwen2MoeConfig and Qwen3MoeConfig assume for a field config.json leaves out."""


def _experts(raw: dict, family: str) -> dict:
    """ModelConfig's mixture-of-experts fields, as the family's transformers class decides them."""
    if family not in _EXPERT_DEFAULTS:
        return {}
    defaults = _EXPERT_DEFAULTS[family]
    spelled = {k: raw[k] for k in ("num_local_experts", "num_experts") if raw.get(k) is not None}
    if len(set(spelled.values())) > 1:
        raise BadInput(f"config.json: num_local_experts={raw['num_local_experts']!r} and num_experts="
                       f"{raw['num_experts']!r} disagree; keep one.")
    experts = next(iter(spelled.values()), defaults["num_local_experts"])
    layers = raw["num_hidden_layers"]
    out = {"num_experts": experts, "experts_per_token": raw.get("num_experts_per_tok", defaults["num_experts_per_tok"])}
    if family == "mixtral":  # every layer; each expert as wide as intermediate_size; top-k always renormalised
        return {**out, "moe_intermediate_size": raw["intermediate_size"], "norm_topk_prob": True,
                "moe_layers": tuple(range(layers))}
    step = raw.get("decoder_sparse_step", defaults["decoder_sparse_step"])
    if isinstance(step, bool) or not isinstance(step, int) or step <= 0:
        raise BadInput(f"config.json: decoder_sparse_step={step!r} must be a positive integer.")
    dense = raw.get("mlp_only_layers") or []
    if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
        raise BadInput(f"config.json: mlp_only_layers={dense!r} must list layer indices.")
    norm = raw.get("norm_topk_prob", defaults["norm_topk_prob"])
    if not isinstance(norm, bool):
        raise BadInput(f"config.json: norm_topk_prob={norm!r} must be true or false.")
    moe_layers = tuple(i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
    out = {**out, "moe_intermediate_size": raw.get("moe_intermediate_size", defaults["moe_intermediate_size"]),
           "norm_topk_prob": norm, "moe_layers": moe_layers}
    if family == "qwen2_moe":  # every expert layer also has a shared expert of this width
        shared = raw.get("shared_expert_intermediate_size", defaults["shared_expert_intermediate_size"])
        if isinstance(shared, bool) or not isinstance(shared, int) or shared <= 0:
            raise BadInput(f"config.json: shared_expert_intermediate_size={shared!r} must be a positive integer.")
        out["shared_expert_intermediate_size"] = shared
    return out


def _family(raw: dict) -> str:
    model_type = raw.get("model_type")
    archs = raw.get("architectures")
    if model_type is None and isinstance(archs, list) and len(archs) == 1:
        model_type = {v: k for k, v in ARCHITECTURES.items()}.get(archs[0])
    if model_type is None and archs is None:
        raise BadInput("config.json names neither model_type nor architectures; Kiln exports "
                       f"{', '.join(f'{t} ({c})' for t, c in ARCHITECTURES.items())}.")
    if model_type not in ARCHITECTURES:
        what = f"model_type={model_type!r}" if "model_type" in raw else f"architectures={archs!r}"
        raise BadInput(f"config.json: {what} is not supported; Kiln exports "
                       f"{', '.join(f'{t} ({c})' for t, c in ARCHITECTURES.items())}.")
    if archs is not None and archs != [ARCHITECTURES[model_type]]:
        raise BadInput(f"config.json: architectures={archs!r} is not supported for model_type {model_type!r}; "
                       f"Kiln exports {ARCHITECTURES[model_type]} (a causal LM head over the decoder).")
    return model_type


def _flag(raw: dict, name: str, default: bool = False) -> bool:
    value = raw.get(name, default)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadInput(f"config.json: {name}={value!r} must be true or false.")
    return value


def _number(raw: dict, name: str, default: float) -> float:
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadInput(f"config.json: {name}={value!r} must be a number.")
    return float(value)


def _dtype(raw: dict) -> str:
    spelled = {k: raw[k] for k in ("dtype", "torch_dtype") if raw.get(k) is not None}
    values = {_DTYPES.get(str(v).removeprefix("torch."), str(v)) for v in spelled.values()}
    if len(values) > 1:
        raise BadInput(f"config.json: dtype={raw['dtype']!r} and torch_dtype={raw['torch_dtype']!r} disagree; "
                       "keep one, or pass --dtype.")
    value = values.pop() if values else "float32"
    if value not in ("float32", "bfloat16", "float16"):
        name = next(iter(spelled))
        raise BadInput(f"config.json: {name}={raw[name]!r} is not supported; Kiln compiles float32, bfloat16 "
                       "or float16 (pass --dtype to choose one).")
    return value


def _rope(raw: dict, family: str = "llama") -> dict:
    """ModelConfig's rope_* fields (and Gemma 3's local_rope_theta) from either spelling."""
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and params and set(params) <= {"full_attention", "sliding_attention"}:
        if family != "gemma3_text":
            raise BadInput(f"config.json: rope_parameters per layer type ({', '.join(params)}) are Gemma 3's; "
                           f"a {family} model has one rope for every layer.")
        local = params.get("sliding_attention") or {}
        if not isinstance(local, dict) or local.get("rope_type", "default") != "default" or set(local) - {
                "rope_type", "rope_theta"}:
            raise BadInput(f"config.json: rope_parameters.sliding_attention={local!r}: Kiln computes sliding "
                           "layers' rotary embedding unscaled (rope_type default, a rope_theta).")
        out = _rope({k: v for k, v in raw.items() if k != "rope_parameters"}
                    | {"rope_parameters": params.get("full_attention") or {}}, "gemma3")
        return {**out, "local_rope_theta": _number(local, "rope_theta", 10000.0)}
    if family == "gemma3_text":
        defaults = _GEMMA_DEFAULTS[family]
        out = _rope({**raw, "rope_theta": raw.get("rope_theta", defaults["rope_theta"])}, "gemma3")
        return {**out, "local_rope_theta": _number(raw, "rope_local_base_freq", defaults["rope_local_base_freq"])}
    scaling = raw.get("rope_scaling")
    if params is not None and scaling is not None:
        raise BadInput("config.json has both rope_parameters (transformers 5) and rope_scaling (4.x); keep one.")
    where = "rope_parameters" if params is not None else "rope_scaling"
    rope = dict(params if params is not None else scaling or {})
    if not isinstance(rope, dict):
        raise BadInput(f"config.json: {where}={rope!r} must be an object or null.")
    if "type" in rope and "rope_type" not in rope:  # the older spelling of rope_type
        rope["rope_type"] = rope.pop("type")
    kind = rope.get("rope_type", "default")
    if kind in _SEQUENCE_DEPENDENT:
        raise BadInput(f"config.json: {where}.rope_type={kind!r} is not supported: {_SEQUENCE_DEPENDENT[kind]}, "
                       "and a compiled step holds padded positions, so it cannot tell where its sequence ends "
                       f"(Kiln computes rope types {', '.join(_ROPE_KEYS)}).")
    if kind not in _ROPE_KEYS:
        raise BadInput(f"config.json: {where}.rope_type={kind!r} is not supported; Kiln computes rope types "
                       f"{', '.join(_ROPE_KEYS)} (a model with {kind!r} would be computed wrongly).")
    extra = sorted(set(rope) - _ROPE_KEYS[kind])
    if extra:
        raise BadInput(f"config.json: {where}.{extra[0]}={rope[extra[0]]!r} is not understood for rope type "
                       f"{kind!r}; Kiln reads {', '.join(sorted(_ROPE_KEYS[kind]))}.")
    # "gemma3": the recursive reading of Gemma 3's full layers' rope, whose default theta is 1e6.
    theta = rope.get("rope_theta", raw.get("rope_theta", 1000000.0 if family == "gemma3" else 10000.0))
    if "rope_theta" in rope and "rope_theta" in raw and rope["rope_theta"] != raw["rope_theta"]:
        raise BadInput(f"config.json: rope_theta={raw['rope_theta']!r} and {where}.rope_theta="
                       f"{rope['rope_theta']!r} disagree; keep one.")
    if isinstance(theta, bool) or not isinstance(theta, (int, float)):
        raise BadInput(f"config.json: rope_theta={theta!r} must be a number.")
    out = {"rope_type": kind, "rope_theta": float(theta)}
    if kind == "yarn":
        return {**out, **_yarn(rope, raw, where)}
    if kind in ("linear", "llama3"):
        if "factor" not in rope:
            raise BadInput(f"config.json: {where} of type {kind!r} lacks factor.")
        out["rope_factor"] = _number(rope, "factor", 1.0)
    if kind == "llama3":
        for key, field in (("low_freq_factor", "rope_low_freq_factor"), ("high_freq_factor", "rope_high_freq_factor"),
                           ("original_max_position_embeddings", "rope_original_max_position")):
            if key not in rope:
                raise BadInput(f"config.json: {where} of type 'llama3' lacks {key}.")
            out[field] = rope[key] if key.startswith("original") else _number(rope, key, 1.0)
    return out


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
        factor = _number(raw, "max_position_embeddings", 0) / old_len
    factor = _number({"factor": factor}, "factor", 1.0)
    if not factor > 0:
        raise BadInput(f"config.json: {where}.factor={factor!r} must be positive.")

    def mscale_of(scale: float, mscale: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0

    attention = rope.get("attention_factor")
    if attention is None:
        mscale, all_dim = rope.get("mscale"), rope.get("mscale_all_dim")
        if mscale and all_dim:
            attention = (mscale_of(factor, _number(rope, "mscale", 1.0))
                         / mscale_of(factor, _number(rope, "mscale_all_dim", 1.0)))
        else:
            attention = mscale_of(factor)
    truncate = rope.get("truncate", True)
    if not isinstance(truncate, bool):
        raise BadInput(f"config.json: {where}.truncate={truncate!r} must be true or false.")
    return {"rope_factor": factor, "rope_original_max_position": old_len,
            "rope_beta_fast": _number(rope, "beta_fast", 32.0) if rope.get("beta_fast") else 32.0,
            "rope_beta_slow": _number(rope, "beta_slow", 1.0) if rope.get("beta_slow") else 1.0,
            "rope_truncate": truncate, "rope_attention_factor": _number({"attention_factor": attention},
                                                                        "attention_factor", 1.0)}


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
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) in ("su", "yarn"):
        raise BadInput(f"config.json: rope type {rope.get('rope_type', rope.get('type'))!r} is Phi3Config's old name "
                       "for 'longrope', which Kiln does not compute: " + _SEQUENCE_DEPENDENT["longrope"] + ".")
    out = _rope(rest if params is None else {**rest, "rope_parameters": params})
    factor = next(iter(spelled.values()), 1.0)
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise BadInput(f"config.json: partial_rotary_factor={factor!r} must be a number in (0, 1].")
    head_dim = raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]
    rotary = int(head_dim * factor)
    if rotary % 2 or rotary <= 0:
        raise BadInput(f"config.json: partial_rotary_factor={factor!r} turns {rotary} of head_dim {head_dim}; the "
                       "rotary embedding needs an even number of dims.")
    return {**out, "rotary_dim": None if rotary == head_dim else rotary}


def _sliding(raw: dict, family: str) -> tuple[int | None, int, tuple[int, ...]]:
    """(sliding_window, first sliding layer, later full-attention layers), as the family's transformers class
    decides them."""
    if family in ("mistral", "mixtral", "phi3"):
        return raw.get("sliding_window"), 0, ()
    if family == "qwen3_moe":  # Qwen3MoeConfig: every layer slides when use_sliding_window (max_window_layers unread)
        return (raw.get("sliding_window", 4096) if _flag(raw, "use_sliding_window") else None), 0, ()
    if family in GEMMA:
        return _gemma_layers(raw, family)
    if family not in ("qwen2", "qwen2_moe", "qwen3") or not _flag(raw, "use_sliding_window") \
            or raw.get("sliding_window") is None:
        return None, 0, ()
    layers = raw["num_hidden_layers"]
    types = raw.get("layer_types")
    if types is None:
        first = raw.get("max_window_layers", 28)
        if isinstance(first, bool) or not isinstance(first, int) or first < 0:
            raise BadInput(f"config.json: max_window_layers={first!r} must be an integer >= 0.")
        return raw["sliding_window"], min(first, layers), ()
    if not isinstance(types, list) or not set(types) <= {"full_attention", "sliding_attention"}:
        raise BadInput(f"config.json: layer_types={types!r} must list 'full_attention' / 'sliding_attention'.")
    first = types.index("sliding_attention") if "sliding_attention" in types else layers
    if types != ["full_attention"] * first + ["sliding_attention"] * (len(types) - first) or len(types) != layers:
        raise BadInput(f"config.json: layer_types={types!r}: Kiln computes full-attention layers followed by "
                       "sliding ones, one entry per layer.")
    return raw["sliding_window"], first, ()


def _gemma_layers(raw: dict, family: str) -> tuple[int | None, int, tuple[int, ...]]:
    """Gemma's interleaving: layer_types, or else a full layer every sliding_window_pattern layers."""
    defaults = _GEMMA_DEFAULTS[family]
    layers = raw["num_hidden_layers"]
    types = raw.get("layer_types")
    if types is None:
        pattern = raw.get("sliding_window_pattern", raw.get("_sliding_window_pattern", defaults["pattern"]))
        if isinstance(pattern, bool) or not isinstance(pattern, int) or pattern <= 0:
            raise BadInput(f"config.json: sliding_window_pattern={pattern!r} must be a positive integer.")
        types = ["full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(layers)]
    if not isinstance(types, list) or not set(types) <= {"full_attention", "sliding_attention"} \
            or len(types) != layers:
        raise BadInput(f"config.json: layer_types={types!r} must list 'full_attention' / 'sliding_attention', one "
                       "entry per layer.")
    window = raw.get("sliding_window", defaults["sliding_window"])
    if window is None or "sliding_attention" not in types:
        return None, 0, ()
    return window, 0, tuple(i for i, kind in enumerate(types) if kind == "full_attention")


def to_hf(cfg: ModelConfig) -> dict:
    """The `config.json` (transformers 4.x spelling) of `cfg`; BadInput for a combination no family has."""
    family = cfg.architecture
    gemma = family in GEMMA
    qwen3 = family in ("qwen3", "qwen3_moe")
    if cfg.qk_norm != (qwen3 or family == "gemma3_text"):
        raise BadInput("q/k norms are Qwen3's and Gemma 3's, and every qwen3, qwen3_moe and gemma3_text config has "
                       "them.")
    gemma_math = (cfg.norm_unit_offset, cfg.sandwich_norms, cfg.embed_scale, cfg.activation == "gelu_tanh",
                  cfg.query_pre_attn_scalar is not None)
    if gemma_math != (gemma,) * 5 or (not gemma and (cfg.attn_softcap or cfg.final_softcap)):
        raise BadInput("Gemma's norms, embedding scale, GeGLU, attention scale and soft caps go together, in "
                       "gemma2 and gemma3_text configs only.")
    if (cfg.local_rope_theta is not None) != (family == "gemma3_text"):
        raise BadInput("a rotary base of the sliding layers' own is Gemma 3's, and every gemma3_text config has one.")
    if cfg.full_attention_layers and not gemma:
        raise BadInput("full-attention layers among sliding ones are Gemma's interleaving.")
    if gemma and (cfg.first_sliding_layer or cfg.mlp_bias or cfg.qkv_bias != cfg.o_bias):
        raise BadInput(f"a {family} config's layers are sliding unless listed full, its attention_bias covers q, "
                       "k, v and o, and it has no mlp_bias.")
    if qwen3 and (cfg.qkv_bias != cfg.o_bias or cfg.mlp_bias):
        raise BadInput(f"a {family} config's attention_bias covers q, k, v and o together; it has no mlp_bias.")
    moe_family = family in _EXPERT_DEFAULTS
    if moe_family != bool(cfg.moe_layers):
        raise BadInput(f"{'a' if moe_family else 'no'} {family} config has mixture-of-experts layers.")
    if family == "mixtral" and (cfg.moe_layers != tuple(range(cfg.num_layers)) or not cfg.norm_topk_prob
                                or cfg.moe_intermediate_size != cfg.intermediate_size):
        raise BadInput("a mixtral config has experts on every layer, as wide as intermediate_size, renormalised.")
    if family == "qwen3_moe" and cfg.sliding_window is not None and cfg.first_sliding_layer:
        raise BadInput("a qwen3_moe config's sliding window covers every layer.")
    if family == "qwen2" and (not cfg.qkv_bias or cfg.o_bias or cfg.mlp_bias):
        raise BadInput("a qwen2 config has q/k/v biases and no other biases.")
    if (family == "qwen2_moe") != bool(cfg.shared_expert_intermediate_size) or (
            family == "qwen2_moe" and (cfg.o_bias or cfg.mlp_bias)):
        raise BadInput("a shared expert is Qwen2-MoE's, every qwen2_moe config has one, and its only biases are "
                       "q/k/v's.")
    if family not in ("qwen2", "qwen2_moe", "qwen3") and cfg.qkv_bias != cfg.o_bias:
        raise BadInput("a llama config's attention_bias covers q, k, v and o together.")
    if family not in ("llama", "qwen3", "qwen3_moe", *GEMMA) and (cfg.o_bias or cfg.mlp_bias):
        raise BadInput(f"a {family} config has no attention_bias / mlp_bias.")
    if cfg.rope_attention_factor != 1.0 and cfg.rope_type != "yarn":
        raise BadInput("a rotary attention factor is yarn's.")
    if cfg.rotary_dim is not None and family != "phi3":
        raise BadInput("a partial rotary (rotary_dim) is Phi-3's partial_rotary_factor.")
    if family == "phi3" and (cfg.qkv_bias or cfg.first_sliding_layer):
        raise BadInput("a phi3 config has no biases, and its sliding window covers every layer.")
    if family == "llama" and cfg.sliding_window is not None:
        raise BadInput("a llama config has no sliding window (use mistral or qwen2).")
    out = {
        "architectures": [ARCHITECTURES[family]], "model_type": family,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": None, "torch_dtype": cfg.dtype,
        "tie_word_embeddings": cfg.tie_word_embeddings,
    }
    if cfg.rope_type == "linear":
        out["rope_scaling"] = {"rope_type": "linear", "factor": cfg.rope_factor}
    elif cfg.rope_type == "yarn":
        out["rope_scaling"] = {"rope_type": "yarn", "factor": cfg.rope_factor,
                               "original_max_position_embeddings": cfg.rope_original_max_position,
                               "beta_fast": cfg.rope_beta_fast, "beta_slow": cfg.rope_beta_slow,
                               "truncate": cfg.rope_truncate, "attention_factor": cfg.rope_attention_factor}
    elif cfg.rope_type == "llama3":
        out["rope_scaling"] = {"rope_type": "llama3", "factor": cfg.rope_factor,
                               "low_freq_factor": cfg.rope_low_freq_factor,
                               "high_freq_factor": cfg.rope_high_freq_factor,
                               "original_max_position_embeddings": cfg.rope_original_max_position}
    if gemma:
        out.update(hidden_activation="gelu_pytorch_tanh", attention_bias=cfg.o_bias,
                   query_pre_attn_scalar=cfg.query_pre_attn_scalar, attn_logit_softcapping=cfg.attn_softcap,
                   final_logit_softcapping=cfg.final_softcap, sliding_window=cfg.sliding_window,
                   layer_types=["sliding_attention" if cfg.window_of(i) else "full_attention"
                                for i in range(cfg.num_layers)])
        if family == "gemma3_text":
            out["rope_local_base_freq"] = cfg.local_rope_theta
    else:
        out["hidden_act"] = "silu"
    if family == "llama":
        out.update(attention_bias=cfg.o_bias, mlp_bias=cfg.mlp_bias)
    elif family in ("mistral", "mixtral", "phi3"):
        out["sliding_window"] = cfg.sliding_window
        if cfg.rotary_dim is not None:
            out["partial_rotary_factor"] = cfg.rotary_dim / cfg.head_dim
    elif family == "qwen3_moe":
        out.update(use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window,
                   attention_bias=cfg.o_bias)
    elif not gemma:
        out.update(use_sliding_window=cfg.sliding_window is not None, sliding_window=cfg.sliding_window,
                   max_window_layers=cfg.first_sliding_layer)
        if family == "qwen3":
            out["attention_bias"] = cfg.o_bias
    if moe_family:
        out.update({"num_experts" if family == "qwen2_moe" else "num_local_experts": cfg.num_experts,
                    "num_experts_per_tok": cfg.experts_per_token})
    if family in ("qwen2_moe", "qwen3_moe"):
        out.update(moe_intermediate_size=cfg.moe_intermediate_size, norm_topk_prob=cfg.norm_topk_prob,
                   decoder_sparse_step=1, mlp_only_layers=[i for i in range(cfg.num_layers) if not cfg.is_moe(i)])
    if family == "qwen2_moe":
        out.update(shared_expert_intermediate_size=cfg.shared_expert_intermediate_size, qkv_bias=cfg.qkv_bias)
    return out
