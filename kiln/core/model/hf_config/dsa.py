"""DeepSeek sparse attention: DeepSeek-V3.2 (DeepseekV32Config) and GLM-5 (GlmMoeDsaConfig) read from a config.json.

Pure: no torch import. DeepSeek-V3's layer (latent attention through a q_lora_rank bottleneck, its rotary pairs
interleaved; the first layers dense, then experts routed by corrected sigmoid scores within groups, with shared
experts), each layer's attention sparse: a lightning indexer of index_n_heads heads of index_head_dim picks the
index_topk tokens each query attends to (kiln.core.model.dsa_fields), its rotary dims in halves for DeepSeek-V3.2,
in interleaved pairs for GLM-5. mlp_layer_types says which layers are dense (by default the first
first_k_dense_replace); layer_types is 'indexed_attention' on every layer. GLM-5's indexer_types (or the
index_topk_pattern / index_topk_freq / index_skip_topk_offset it is derived from) may have a layer reuse the
previous layer's picks ('shared'): refused by name, Kiln runs every layer's own indexer. config.json's head_dim
and qk_head_dim are what the class sets them to (qk_rope_head_dim, and qk_nope_head_dim + qk_rope_head_dim).
A field config.json leaves out takes the class's default (DeepSeek-V3.2's and GLM-5's sizes).
"""

from __future__ import annotations

from kiln.core.errors import BadInput
from kiln.core.model.config import ModelConfig
from kiln.core.model.dsa_fields import DsaFields
from kiln.core.model.hf_config.common import (COMMON_READ, EXPERTS, GROUPED_ROUTER, LATENT, SHARED_EXPERT, Family,
                                              flag, positive_int, shared_fields, silu)
from kiln.core.model.hf_config.deepseek import (attention_scale, expert_fields, latent_and_experts_hf, latent_fields,
                                                mscale_all_dim)
from kiln.core.model.hf_config.rope import rope_fields, rope_scaling

_SHARED = {"vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
           "n_shared_experts": 1, "n_routed_experts": 256, "routed_scaling_factor": 2.5, "kv_lora_rank": 512,
           "qk_rope_head_dim": 64, "num_experts_per_tok": 8, "norm_topk_prob": True, "first_k_dense_replace": 3,
           "attention_bias": False, "index_topk": 2048, "index_head_dim": 128, "tie_word_embeddings": False}
_DEFAULTS = {
    "deepseek_v32": {**_SHARED, "num_hidden_layers": 61, "num_attention_heads": 128, "q_lora_rank": 1536,
                     "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8, "topk_group": 4, "rms_norm_eps": 1e-6,
                     "index_n_heads": 64},
    "glm_moe_dsa": {**_SHARED, "vocab_size": 154880, "hidden_size": 6144, "intermediate_size": 12288,
                    "num_hidden_layers": 78, "num_attention_heads": 64, "q_lora_rank": 2048, "v_head_dim": 256,
                    "qk_nope_head_dim": 192, "n_group": 1, "topk_group": 1, "rms_norm_eps": 1e-5, "index_n_heads": 32},
}
"""DeepseekV32Config's and GlmMoeDsaConfig's defaults (transformers 5.25) for the fields Kiln reads."""
_INERT = {"mlp_bias": "DeepseekV32MLP and GlmMoeDsaMLP never read it",
          "head_dim": "the class sets it to qk_rope_head_dim whatever config.json says",
          "qk_head_dim": "the class sets it to qk_nope_head_dim + qk_rope_head_dim whatever config.json says",
          "num_key_value_heads": "every head reads the one latent",
          "num_nextn_predict_layers": "the multi-token-prediction module, used only for speculative decoding, "
                                      "not in one step"}
_SHARING = ("indexer_types", "index_topk_pattern", "index_topk_freq", "index_skip_topk_offset")


def _indexer_types(raw: dict, layers: int) -> list[str]:
    """GLM-5's indexer_types as GlmMoeDsaConfig derives them (a pattern, else the freq/offset schedule)."""
    if raw.get("indexer_types") is not None:
        return raw["indexer_types"]
    pattern = raw.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq, offset = max(raw.get("index_topk_freq", 1), 1), raw.get("index_skip_topk_offset", 2)
    return ["full" if (max(i - offset + 1, 0) % freq) == 0 else "shared" for i in range(layers)]


def _layer_lists(raw: dict, family: str, layers: int) -> tuple[int, ...]:
    """The expert layers, by mlp_layer_types or first_k_dense_replace; layer_types and indexer_types checked."""
    types = raw.get("layer_types")
    if types is not None and types != ["indexed_attention"] * layers:
        raise BadInput(f"config.json: layer_types={types!r}: every {family} layer is 'indexed_attention'.")
    if family == "glm_moe_dsa" and (indexer := _indexer_types(raw, layers)) != ["full"] * layers:
        raise BadInput(f"config.json: indexer_types {indexer!r}: a 'shared' layer reuses the previous layer's top-k "
                       "picks (GLM-5's cross-layer sharing), which Kiln does not compute; it exports GLM-5 with every "
                       "layer's own indexer ('full').")
    mlp = raw.get("mlp_layer_types")
    if mlp is None:
        dense = min(raw["first_k_dense_replace"], layers)
        mlp = ["dense"] * dense + ["sparse"] * (layers - dense)
    if not isinstance(mlp, list) or len(mlp) != layers or not set(mlp) <= {"dense", "sparse"}:
        raise BadInput(f"config.json: mlp_layer_types={mlp!r} must list 'dense' or 'sparse' for each of the {layers} "
                       "layers.")
    return tuple(i for i, kind in enumerate(mlp) if kind == "sparse")


def _reader(family: str):
    def read(raw: dict) -> ModelConfig:
        raw = {**_DEFAULTS[family], **raw}
        if raw.get("num_experts") is not None:  # DeepseekV32Config's older spelling, re-routed as it re-routes it
            raw = {**raw, "n_routed_experts": raw.pop("num_experts")}
        if raw.get("rope_interleave", True) is not True:
            raise BadInput(f"config.json: rope_interleave={raw['rope_interleave']!r}: {family}'s latent attention "
                           "always turns interleaved pairs.")
        layers = positive_int(raw, "num_hidden_layers", 0)
        moe = _layer_lists(raw, family, layers)
        # head_dim and qk_head_dim are what the class overwrites them with (inert): not held to DeepSeek-V3's rule
        latent = latent_fields({k: v for k, v in raw.items() if k not in ("head_dim", "qk_head_dim")}
                               | {"rope_interleave": True})
        rope = rope_fields(raw, family)
        dsa = DsaFields(index_heads=positive_int(raw, "index_n_heads", 0),
                        index_head_dim=positive_int(raw, "index_head_dim", 0),
                        index_topk=positive_int(raw, "index_topk", 0), rope_interleave=family == "glm_moe_dsa")
        return ModelConfig(**{**shared_fields(raw, family), **latent, "num_kv_heads": raw["num_attention_heads"]},
                           activation=silu(raw), o_bias=flag(raw, "attention_bias"),
                           **{**expert_fields(raw), "moe_layers": moe}, **rope,
                           attn_scale_multiplier=attention_scale(raw, rope), dsa=dsa)
    return read


def _to_hf(cfg: ModelConfig) -> dict:
    if cfg.router != "sigmoid_groups" or cfg.qkv_bias or cfg.mlp_bias or not cfg.rope_interleave:
        raise BadInput(f"a {cfg.architecture} config routes by sigmoid scores within groups and turns interleaved "
                       "pairs; it has no q/k/v or MLP biases.")
    rope = {}
    if cfg.attn_scale_multiplier != 1.0:
        rope["rope_scaling"] = {**rope_scaling(cfg), "mscale_all_dim": mscale_all_dim(cfg)}
    hf = {k: v for k, v in latent_and_experts_hf(cfg).items() if k != "rope_interleave"}
    return {**rope, "hidden_act": "silu", **hf, "head_dim": cfg.qk_rope_head_dim, "qk_head_dim": cfg.head_dim,
            "mlp_layer_types": ["sparse" if cfg.is_moe(i) else "dense" for i in range(cfg.num_layers)],
            "index_n_heads": cfg.dsa.index_heads, "index_head_dim": cfg.dsa.index_head_dim,
            "index_topk": cfg.dsa.index_topk}


_READ = COMMON_READ | {"kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "qk_nope_head_dim", "v_head_dim",
                       "rope_interleave", "attention_bias", "n_routed_experts", "num_local_experts", "num_experts",
                       "num_experts_per_tok", "moe_intermediate_size", "n_shared_experts", "routed_scaling_factor",
                       "n_group", "topk_group", "first_k_dense_replace", "norm_topk_prob", "mlp_layer_types",
                       "layer_types", "index_n_heads", "index_head_dim", "index_topk"}
DEEPSEEK_V32 = Family("deepseek_v32", _READ, _reader("deepseek_v32"), _to_hf,
                      features=(EXPERTS, SHARED_EXPERT, LATENT, GROUPED_ROUTER), required=(), inert=_INERT)
GLM_MOE_DSA = Family("glm_moe_dsa", _READ | set(_SHARING), _reader("glm_moe_dsa"), _to_hf,
                     features=(EXPERTS, SHARED_EXPERT, LATENT, GROUPED_ROUTER), required=(), inert=_INERT)
