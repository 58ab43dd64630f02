"""What every family's reading shares: the Family record, the inert fields, and the readers of one value.

Pure: no torch import. A family module (llama.py, qwen.py, ...) declares one `Family` per model_type:
the fields its config.json may hold that change the math (`read`), how they map onto ModelConfig
(`from_raw`) and back (`to_hf`), and which of the parts only some families have (`Feature`) its configs can
hold. The readers here raise BadInput naming the field and its value, so every family refuses alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kiln.core.model.config import ARCHITECTURES, ModelConfig
from kiln.core.errors import BadInput

COMMON_READ = frozenset({
    "architectures", "model_type", "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps", "hidden_act", "rope_theta",
    "rope_scaling", "rope_parameters", "dtype", "torch_dtype", "tie_word_embeddings"})
"""Fields every family reads: the sizes, the norm's epsilon, the activation, the rope, the dtype, tied embeddings."""

REQUIRED = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size")
"""Fields a config.json must hold unless its family declares defaults for them."""

INERT = {
    "transformers_version": "the library that wrote the file",
    "_name_or_path": "where the file came from",
    "bos_token_id": "a tokenizer id", "eos_token_id": "a tokenizer id", "pad_token_id": "a tokenizer id",
    "use_cache": "a generate() setting", "initializer_range": "how random weights are drawn",
    "max_position_embeddings": "a documented limit (Kiln's own is the recipe's max_context_tokens); read only by "
                               "the rope types dynamic (its threshold) and longrope (its default factor)",
    "attention_dropout": "dropout is off at inference", "pretraining_tp": "splits the same matmuls (same math)",
    "output_attentions": "a generate() setting", "output_hidden_states": "a generate() setting",
    "return_dict": "a generate() setting", "tokenizer_class": "a tokenizer setting",
    "output_router_logits": "a training output (the router's logits for the auxiliary loss)",
    "router_aux_loss_coef": "a training loss weight", "router_jitter_noise": "noise applied in training only",
    "cache_implementation": "a generate() setting (which cache class it builds)",
    "resid_pdrop": "dropout is off at inference", "embd_pdrop": "dropout is off at inference",
}
"""Fields that do not change what a forward step computes, with why; every family accepts them."""


@dataclass(frozen=True)
class Feature:
    """A part of ModelConfig that only some families' configs hold. to_hf refuses a ModelConfig that holds
    one its family does not list; a family that always has it checks that in its own to_hf."""

    what: str
    """What it is, as a refusal names it."""
    held_by: Callable[[ModelConfig], bool]
    """Whether a ModelConfig holds it."""


QK_NORM = Feature("q/k norms (qk_norm)", lambda cfg: cfg.qk_norm)
QK_NORM_WHOLE = Feature("q/k norms over all heads (qk_norm_whole)", lambda cfg: cfg.qk_norm_whole)
GEMMA_MATH = Feature(
    "Gemma's norms, embedding scale, GeGLU, attention scale and soft caps",
    lambda cfg: any((cfg.norm_unit_offset, cfg.sandwich_norms, cfg.embed_scale, cfg.activation == "gelu_tanh",
                     cfg.query_pre_attn_scalar is not None, cfg.attn_softcap, cfg.final_softcap)))
LOCAL_ROPE = Feature("a rotary base of the sliding layers' own (local_rope_theta)",
                     lambda cfg: cfg.local_rope_theta is not None)
INTERLEAVED = Feature("full-attention layers among sliding ones (full_attention_layers)",
                      lambda cfg: bool(cfg.full_attention_layers))
SLIDING = Feature("a sliding window", lambda cfg: cfg.sliding_window is not None)
EXPERTS = Feature("mixture-of-experts layers", lambda cfg: bool(cfg.moe_layers))
SHARED_EXPERT = Feature("a shared expert (shared_expert_intermediate_size)",
                        lambda cfg: bool(cfg.shared_expert_intermediate_size))
PARTIAL_ROTARY = Feature("a partial rotary (rotary_dim, Phi-3's partial_rotary_factor)",
                         lambda cfg: cfg.rotary_dim is not None)
LATENT = Feature(
    "latent attention (kv_lora_rank, q_lora_rank, qk_rope_head_dim, v_head_dim, rope_interleave, "
    "attn_scale_multiplier)",
    lambda cfg: bool(cfg.kv_lora_rank or cfg.q_lora_rank or cfg.qk_rope_head_dim or cfg.v_head_dim
                     or cfg.rope_interleave or cfg.attn_scale_multiplier != 1.0))
GROUPED_ROUTER = Feature(
    "grouped sigmoid routing (router sigmoid_groups, num_expert_groups, topk_groups, routed_scaling_factor)",
    lambda cfg: cfg.router not in ("softmax", "sigmoid_input")  # Llama 4's own: kiln.core.model.llama4_fields
    or (cfg.num_expert_groups, cfg.topk_groups, cfg.routed_scaling_factor) != (1, 1, 1.0))
FEATURES = (QK_NORM, QK_NORM_WHOLE, GEMMA_MATH, LOCAL_ROPE, INTERLEAVED, SLIDING, EXPERTS, SHARED_EXPERT,
            PARTIAL_ROTARY, LATENT, GROUPED_ROUTER)
"""Every Feature; to_hf checks each."""


@dataclass(frozen=True)
class Family:
    """One model_type, as its transformers config class reads a config.json."""

    name: str
    """The model_type (a key of kiln.core.model.config.ARCHITECTURES)."""
    read: frozenset[str]
    """The fields its config.json may hold that change the math; Kiln reads or checks every one."""
    from_raw: Callable[[dict], ModelConfig]
    """The ModelConfig of a config.json that holds only `read` and INERT fields and every `required` one;
    BadInput naming a value Kiln does not compute."""
    to_hf: Callable[[ModelConfig], dict]
    """The family's own fields of a ModelConfig's config.json, added to (or replacing) the ones every family
    writes (common.shared_hf); BadInput for a combination no config of the family has."""
    features: tuple[Feature, ...] = ()
    """The Features its configs can hold."""
    required: tuple[str, ...] = REQUIRED
    """Fields its config.json must hold (the family's class has no default Kiln takes for them)."""
    inert: Mapping[str, str] = field(default_factory=dict)
    """Fields inert for this family only (beyond INERT), with why."""


def flag(raw: dict, name: str, default: bool = False) -> bool:
    """A true/false field; null reads as false, as transformers' `if config.<name>:` does."""
    value = raw.get(name, default)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise BadInput(f"config.json: {name}={value!r} must be true or false.")
    return value


def number(raw: dict, name: str, default: float) -> float:
    """A numeric field, as a float."""
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadInput(f"config.json: {name}={value!r} must be a number.")
    return float(value)


def positive_int(raw: dict, name: str, default: int) -> int:
    """An integer field that must be positive."""
    value = raw.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise BadInput(f"config.json: {name}={value!r} must be a positive integer.")
    return value


def aliased(raw: dict, names: tuple[str, ...], default):
    """The value of a field spelled several ways (`names`, each non-null spelling must agree), else `default`."""
    spelled = {k: raw[k] for k in names if raw.get(k) is not None}
    values = list(spelled.values())
    if any(v != values[0] for v in values[1:]):
        raise BadInput(f"config.json: {' and '.join(f'{k}={v!r}' for k, v in spelled.items())} disagree; keep one.")
    return next(iter(spelled.values()), default)


_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "fp32": "float32",
           "bf16": "bfloat16", "fp16": "float16", "half": "float16", "float": "float32"}


def dtype(raw: dict) -> str:
    """The weights' dtype (dtype, or 4.x's torch_dtype); float32 when neither is given."""
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


def silu(raw: dict) -> str:
    """The SwiGLU MLP's activation: hidden_act must be silu (its default)."""
    if raw.get("hidden_act", "silu") != "silu":
        raise BadInput(f"config.json: hidden_act={raw['hidden_act']!r}: Kiln computes the SwiGLU MLP with silu only.")
    return "silu"


def shared_fields(raw: dict, family: str, *, head_dim: int | None = None, rms_norm_eps: float = 1e-6,
                  tie_word_embeddings: bool = False) -> dict:
    """ModelConfig's keyword arguments that every family reads alike: sizes, epsilon, dtype, tied embeddings.
    The keywords are the family class's defaults for a field config.json leaves out (head_dim None:
    hidden_size / num_attention_heads); a null or zero head_dim reads as its default too."""
    heads, hidden = raw["num_attention_heads"], raw["hidden_size"]
    width = raw.get("head_dim") or (head_dim or (hidden // heads if isinstance(hidden, int) and isinstance(heads, int)
                                                 and heads else 0))
    return {"architecture": family, "vocab_size": raw["vocab_size"], "hidden_size": hidden,
            "num_layers": raw["num_hidden_layers"], "num_heads": heads,
            "num_kv_heads": raw.get("num_key_value_heads") or heads, "head_dim": width,
            "intermediate_size": raw["intermediate_size"],
            "rms_norm_eps": number(raw, "rms_norm_eps", rms_norm_eps), "dtype": dtype(raw),
            "tie_word_embeddings": flag(raw, "tie_word_embeddings", tie_word_embeddings)}


def shared_hf(cfg: ModelConfig, rope_scaling: dict | None) -> dict:
    """The fields every family's config.json holds (transformers 4.x spelling), in the order they are written."""
    return {
        "architectures": [ARCHITECTURES[cfg.architecture]], "model_type": cfg.architecture,
        "vocab_size": cfg.vocab_size, "hidden_size": cfg.hidden_size, "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads, "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size, "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta, "rope_scaling": rope_scaling, "torch_dtype": cfg.dtype,
        "tie_word_embeddings": cfg.tie_word_embeddings,
    }
