"""config.json -> ModelConfig: both spellings, every family, refusals by field, keys that cover the math."""

from __future__ import annotations

import dataclasses
import json
import math
import re

import pytest

from kiln.core.model.config import TINY, ModelConfig
from kiln.core.errors import BadInput
from kiln.core.model.hf_config import from_hf, to_hf
from kiln.core.model.quant import WeightQuant
from kiln.core.plan.job import ExportJob
from kiln.core.plan.recipe import Recipe

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 512, "hidden_size": 128,
         "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "rms_norm_eps": 1e-6, "hidden_act": "silu", "transformers_version": "4.46.0", "bos_token_id": 1}


def test_transformers_4_and_5_spellings_read_the_same():
    v4 = {**LLAMA, "rope_theta": 500000.0, "torch_dtype": "bfloat16", "tie_word_embeddings": True,
          "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                           "original_max_position_embeddings": 8192}}
    v5 = {**LLAMA, "dtype": "bfloat16", "tie_word_embeddings": True,
          "rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
                              "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192}}
    a, b = from_hf(v4), from_hf(v5)
    assert a == b
    assert (a.dtype, a.rope_type, a.rope_theta, a.rope_factor, a.tie_word_embeddings) == \
        ("bfloat16", "llama3", 500000.0, 32.0, True)
    # The older `type` key of rope_scaling still means rope_type; transformers 5 writes both when it converted one.
    assert from_hf({**LLAMA, "rope_scaling": {"type": "linear", "factor": 2.0}}).rope_type == "linear"
    both = {"type": "linear", "rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}
    assert from_hf({**LLAMA, "rope_parameters": both}).rope_type == "linear"
    with pytest.raises(BadInput, match="rope_parameters.type='yarn' and rope_parameters.rope_type='linear' disagree"):
        from_hf({**LLAMA, "rope_parameters": {**both, "type": "yarn"}})


def test_families():
    qwen = from_hf({**LLAMA, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                    "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28})
    assert qwen.qkv_bias and not qwen.o_bias and qwen.sliding_window is None
    qwen_window = from_hf({**LLAMA, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                           "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 1})
    assert qwen_window.sliding_window == 64 and [qwen_window.window_of(i) for i in range(2)] == [None, 64]
    by_types = from_hf({**LLAMA, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                        "use_sliding_window": True, "sliding_window": 64,
                        "layer_types": ["full_attention", "sliding_attention"]})
    assert by_types == qwen_window.replace(first_sliding_layer=1)
    mistral = from_hf({**LLAMA, "architectures": ["MistralForCausalLM"], "model_type": "mistral", "sliding_window": 8})
    assert [mistral.window_of(i) for i in range(2)] == [8, 8]
    biased = from_hf({**LLAMA, "attention_bias": True, "mlp_bias": True})
    assert biased.qkv_bias and biased.o_bias and biased.mlp_bias
    assert from_hf(LLAMA).head_dim == 32  # hidden / heads when head_dim is absent
    qwen3 = from_hf({**LLAMA, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 64,
                     "attention_bias": True, "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1})
    assert (qwen3.qk_norm, qwen3.head_dim, qwen3.qkv_bias, qwen3.o_bias, qwen3.mlp_bias) == (True, 64, True, True, False)
    assert [qwen3.window_of(i) for i in range(2)] == [None, 16]
    assert not from_hf({**LLAMA, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"}).qk_norm
    # Qwen3Config's own default head_dim is 128, whatever hidden_size / heads is.
    assert from_hf({**LLAMA, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}).head_dim == 128
    with pytest.raises(BadInput, match="mlp_bias"):
        from_hf({**LLAMA, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "mlp_bias": True})


def test_to_hf_round_trips():
    for cfg in (TINY, from_hf({**LLAMA, "attention_bias": True, "tie_word_embeddings": True}),
                from_hf({**LLAMA, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
                         "sliding_window": 8, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}),
                from_hf({**LLAMA, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 64,
                         "attention_bias": True, "use_sliding_window": True, "sliding_window": 16,
                         "max_window_layers": 1})):
        assert from_hf(to_hf(cfg)) == cfg


GEMMA2 = {**LLAMA, "architectures": ["Gemma2ForCausalLM"], "model_type": "gemma2", "head_dim": 32,
          "hidden_activation": "gelu_pytorch_tanh", "num_hidden_layers": 4}
GEMMA3 = {**GEMMA2, "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text"}
for _gemma in (GEMMA2, GEMMA3):
    del _gemma["hidden_act"]


def test_gemma_reads_as_its_transformers_classes_default():
    g2 = from_hf(GEMMA2)
    assert (g2.activation, g2.norm_unit_offset, g2.sandwich_norms, g2.embed_scale, g2.tie_word_embeddings) == \
        ("gelu_tanh", True, True, True, True)
    # Gemma2Config's defaults: caps 50 and 30, query_pre_attn_scalar 256, window 4096 on every other layer.
    assert (g2.attn_softcap, g2.final_softcap, g2.query_pre_attn_scalar) == (50.0, 30.0, 256.0)
    assert [g2.window_of(i) for i in range(4)] == [4096, None, 4096, None] and not g2.qk_norm
    assert from_hf({k: v for k, v in GEMMA2.items() if k != "head_dim"}).head_dim == 256
    g3 = from_hf({**GEMMA3, "num_hidden_layers": 7, "rope_scaling": {"rope_type": "linear", "factor": 8.0}})
    # Gemma3TextConfig's: no caps, a full layer every sixth, theta 1e6 (scaled) on full layers, 1e4 on sliding ones.
    assert (g3.attn_softcap, g3.final_softcap, g3.qk_norm) == (None, None, True)
    assert [i for i in range(7) if g3.window_of(i) is None] == [5]
    assert (g3.rope_theta, g3.rope_type, g3.rope_factor, g3.local_rope_theta) == (1e6, "linear", 8.0, 1e4)
    v5 = {**{k: v for k, v in GEMMA3.items()}, "num_hidden_layers": 7,
          "layer_types": ["sliding_attention"] * 5 + ["full_attention", "sliding_attention"],
          "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                              "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
    assert from_hf(v5) == g3
    for cfg in (g2, g3, from_hf({**GEMMA2, "layer_types": ["full_attention"] * 4, "attn_logit_softcapping": None})):
        assert from_hf(to_hf(cfg)) == cfg


GEMMA_REFUSED = [
    (GEMMA2, {"hidden_activation": "gelu"}, "hidden_activation='gelu'"),
    (GEMMA2, {"hidden_act": "silu"}, "disagree"),
    (GEMMA2, {"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    (GEMMA2, {"layer_types": ["full_attention"]}, "one entry per layer"),
    (GEMMA2, {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e4}}}, "Gemma 3's"),
    (GEMMA3, {"rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": 1e6},
                                  "sliding_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}}},
     "sliding_attention"),
    (GEMMA2, {"final_logit_softcapping": -1.0}, "final_logit_softcapping"),
]


@pytest.mark.parametrize("base,change,words", GEMMA_REFUSED, ids=[w for _, _, w in GEMMA_REFUSED])
def test_gemma_values_outside_what_kiln_computes_are_refused_by_name(base, change, words):
    with pytest.raises(BadInput, match="config.json") as err:
        from_hf({**base, **change})
    assert words in str(err.value)


def test_yarn_reads_as_transformers_derives_it():
    """The attention factor from factor (Qwen2.5's spelling), or from the mscale pair (DeepSeek's); betas 32 / 1,
    truncation on and the original context from max_position_embeddings when absent; both spellings alike."""
    qwen = from_hf({**LLAMA, "rope_scaling": {"type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 32768}})
    assert (qwen.rope_type, qwen.rope_factor, qwen.rope_original_max_position) == ("yarn", 4.0, 32768)
    assert (qwen.rope_beta_fast, qwen.rope_beta_slow, qwen.rope_truncate) == (32.0, 1.0, True)
    assert qwen.rope_attention_factor == pytest.approx(0.1 * math.log(4.0) + 1.0)
    deepseek = {"rope_type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096, "mscale": 0.707,
                "mscale_all_dim": 1.0, "beta_fast": 16, "beta_slow": 2, "truncate": False}
    v4 = from_hf({**LLAMA, "rope_scaling": deepseek})
    v5 = from_hf({**LLAMA, "rope_parameters": {**deepseek, "rope_theta": 10000.0}})
    assert v4 == v5 and (v4.rope_beta_fast, v4.rope_beta_slow, v4.rope_truncate) == (16.0, 2.0, False)
    assert v4.rope_attention_factor == pytest.approx((0.0707 * math.log(40) + 1) / (0.1 * math.log(40) + 1))
    assert from_hf({**LLAMA, "rope_scaling": {**deepseek, "mscale_all_dim": 0.707}}).rope_attention_factor == 1.0
    implied = from_hf({**LLAMA, "max_position_embeddings": 8192,
                       "rope_scaling": {"rope_type": "yarn", "factor": None, "original_max_position_embeddings": 2048}})
    assert implied.rope_factor == 4.0
    assert from_hf({**LLAMA, "max_position_embeddings": 512,
                    "rope_scaling": {"rope_type": "yarn", "factor": 2.0}}).rope_original_max_position == 512
    for cfg in (qwen, v4, implied):
        assert from_hf(to_hf(cfg)) == cfg


PHI3 = {**{k: v for k, v in LLAMA.items() if k != "rms_norm_eps"}, "architectures": ["Phi3ForCausalLM"],
        "model_type": "phi3", "hidden_size": 256, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
        "original_max_position_embeddings": 4096, "sliding_window": 2047}


def test_phi3_reads_as_phi3config():
    """Phi3Config's defaults (rms_norm_eps 1e-5, every layer sliding when sliding_window is set) and its
    partial rotary in both spellings (top level; transformers 5's rope_parameters)."""
    cfg = from_hf(PHI3)
    assert (cfg.architecture, cfg.rms_norm_eps, cfg.head_dim, cfg.rotary_dim, cfg.rotated_dims) == \
        ("phi3", 1e-5, 64, None, 64)
    assert [cfg.window_of(i) for i in range(2)] == [2047, 2047]
    v4 = from_hf({**PHI3, "partial_rotary_factor": 0.75})
    v5 = from_hf({**PHI3, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                              "partial_rotary_factor": 0.75}})
    both = from_hf({**PHI3, "partial_rotary_factor": 0.75,
                    "rope_parameters": {"rope_theta": 1e4, "partial_rotary_factor": 0.75, "rope_type": "default"}})
    assert v4 == v5 == both and v4.rotary_dim == 48
    for c in (cfg, v4):
        assert from_hf(to_hf(c)) == c


def test_phi3_longrope_reads_as_phi3config():
    """Phi-3's longrope (Phi-3.5, Phi-4-mini): the factor lists; Phi3Config's top-level
    original_max_position_embeddings before the rope's own; its old names su and yarn; the attention factor
    sqrt(1 + ln(factor) / ln(original)) with factor max_position_embeddings / original unless given."""
    rope = {"rope_type": "longrope", "short_factor": [1.0] * 32, "long_factor": [2.0] * 32}
    raw = {**PHI3, "max_position_embeddings": 131072, "rope_scaling": rope}
    cfg = from_hf(raw)
    assert (cfg.rope_type, cfg.rope_original_max_position, cfg.length_dependent_rope) == ("longrope", 4096, True)
    assert cfg.rope_short_factor == (1.0,) * 32 and cfg.rope_long_factor == (2.0,) * 32
    assert cfg.rope_attention_factor == pytest.approx(math.sqrt(1 + math.log(32) / math.log(4096)))
    assert from_hf({**raw, "rope_scaling": {**rope, "original_max_position_embeddings": 64}}) == cfg
    for old in ("su", "yarn"):
        assert from_hf({**raw, "rope_scaling": {**rope, "rope_type": old}}) == cfg
    v5 = {k: v for k, v in raw.items() if k != "rope_scaling"} | {"rope_parameters": {**rope, "rope_theta": 1e4}}
    assert from_hf(v5) == cfg
    assert from_hf({**raw, "rope_scaling": {**rope, "attention_factor": 1.5}}).rope_attention_factor == 1.5
    assert from_hf(to_hf(cfg)) == cfg


def test_dynamic_rope_reads_its_threshold():
    """The dynamic rope's base grows past max_position_embeddings, which it therefore reads."""
    cfg = from_hf({**LLAMA, "max_position_embeddings": 2048, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})
    assert (cfg.rope_type, cfg.rope_factor, cfg.rope_max_position, cfg.length_dependent_rope) == \
        ("dynamic", 2.0, 2048, True)
    assert from_hf(to_hf(cfg)) == cfg
    assert not from_hf({**LLAMA, "max_position_embeddings": 2048}).length_dependent_rope


PHI3_REFUSED = [
    ({"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 16, "long_factor": [2.0] * 32}},
     "must list 32 positive numbers"),
    ({"rope_scaling": {"rope_type": "longrope", "long_factor": [2.0] * 32}}, "needs short_factor"),
    ({"partial_rotary_factor": 0.5, "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.75}},
     "disagree"),
    ({"partial_rotary_factor": 0.3}, "even number"),
    ({"partial_rotary_factor": 1.5}, "(0, 1]"),
    ({"attention_bias": True}, "attention_bias=True"),
]


@pytest.mark.parametrize("change,words", PHI3_REFUSED, ids=[w for _, w in PHI3_REFUSED])
def test_phi3_values_outside_what_kiln_computes_are_refused_by_name(change, words):
    with pytest.raises(BadInput, match="config.json") as err:
        from_hf({**PHI3, **change})
    assert words in str(err.value)


REFUSED = [
    # (change to a valid Llama config, words the message must hold)
    ({"rope_scaling": {"rope_type": "yarn", "original_max_position_embeddings": 4096}}, "lacks factor"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "needs original_max_position_embeddings"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16, "ntk": 1}},
     "ntk=1"),
    ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}}, "needs max_position_embeddings"),
    ({"max_position_embeddings": 64, "rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 16,
                                                      "long_factor": [2.0] * 16}}, "for Phi-3 only"),
    ({"max_position_embeddings": 64, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0, "beta": 1}}, "beta=1"),
    ({"rope_scaling": {"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.5}}, "partial_rotary_factor"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0}}, "lacks low_freq_factor"),
    ({"model_type": "gemma", "architectures": ["GemmaForCausalLM"]}, "model_type='gemma'"),
    ({"architectures": ["LlamaForSequenceClassification"]}, "LlamaForSequenceClassification"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"sliding_window": 8}, "sliding_window=8"),  # Llama has none: a Llama file that says so is not understood
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ({"logit_softcapping": 30.0}, "logit_softcapping=30.0"),
    ({"dtype": "float8_e4m3fn"}, "float8_e4m3fn"),
    ({"dtype": "float32", "torch_dtype": "bfloat16"}, "disagree"),
    ({"rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, "disagree"),
    ({"attention_bias": "yes"}, "attention_bias='yes'"),
    ({"rope_scaling": "yarn"}, "rope_scaling='yarn' must be an object"),
]


@pytest.mark.parametrize("change,words", REFUSED, ids=[w for _, w in REFUSED])
def test_what_kiln_does_not_compute_is_refused_by_name(change, words):
    with pytest.raises(BadInput, match="config.json") as err:
        from_hf({**LLAMA, **change})
    assert words in str(err.value)


def test_qwen2_layer_types_that_interleave_are_refused():
    with pytest.raises(BadInput, match="layer_types"):
        from_hf({**LLAMA, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "use_sliding_window": True,
                 "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"]})


LLAMA4_FIELDS = {"attention_chunk_size": 8, "nope_layers": (1,), "qk_l2_norm": True, "temperature_floor": 4,
                 "temperature_scale": 0.5}
"""Llama 4's own fields, each a value other than its default."""
LATENT_FIELDS = {"kv_lora_rank": 64, "q_lora_rank": 48, "qk_rope_head_dim": 4, "v_head_dim": 32}
LONGROPE = {"rope_type": "longrope", "rope_short_factor": (1.0,) * 8, "rope_long_factor": (2.0,) * 8}
"""A longrope model's fields (TINY's head_dim 16: 8 rotated pairs); its factors are changed on it."""


def _changed(cfg: ModelConfig, field: dataclasses.Field):
    """A valid value of `field` other than cfg's."""
    value = getattr(cfg, field.name)
    special = {"dtype": "bfloat16", "architecture": "mistral", "rope_type": "linear", "sliding_window": 8,
               "num_heads": 48, "num_kv_heads": 6, "first_sliding_layer": 1, "moe_layers": (0, 1),
               "full_attention_layers": (1,), "activation": "gelu_tanh", "query_pre_attn_scalar": 24.0,
               "attn_softcap": 50.0, "final_softcap": 30.0, "local_rope_theta": 1e4,
               "shared_expert_intermediate_size": 64, "rotary_dim": 8, "router": "sigmoid_groups", "query_scale_beta": 0.1,
               "rope_short_factor": (1.5,) * 8, "rope_long_factor": (3.0,) * 8,
               "quant": WeightQuant("fp8_blocks", (128, 128)), **LATENT_FIELDS}
    if field.name in special:
        return special[field.name]
    if isinstance(value, bool):
        return not value
    if isinstance(value, int):
        return value * 2
    return value * 2.5


def test_every_config_field_is_in_the_forward_key():
    """Change each field alone: the key changes, so no cached forward of one model serves another."""
    def key(cfg: ModelConfig) -> str:
        job = ExportJob(export_id="k", model_name="m", checkpoint="/none", config=cfg.to_dict(), tp=1,
                        recipe=Recipe(), store_url="file:///none")
        return job.specs(target="t", torch_version="v", code="c", compiler={})[0].key

    # A mixture of experts on layer 0, so that every expert field changes what the model computes.
    base = TINY.replace(rope_type="llama3", rope_factor=8.0, num_experts=4, experts_per_token=2,
                        moe_intermediate_size=96, moe_layers=(0,), num_expert_groups=2)
    # Latent attention's widths only mean something together: each is changed alone on a latent model.
    latent = base.replace(kv_lora_rank=32, qk_rope_head_dim=8, v_head_dim=16, num_kv_heads=24)
    longrope = base.replace(**LONGROPE)
    dynamic = base.replace(rope_type="dynamic", rope_max_position=64)
    oss = base.replace(architecture="gpt_oss", attention_sinks=True, swiglu_limit=7.0)
    llama4 = base.replace(architecture="llama4_text", router="sigmoid_input", num_expert_groups=1)
    seen = {key(base), key(latent), key(longrope), key(dynamic), key(oss), key(llama4)}
    for field in dataclasses.fields(ModelConfig):
        if field.name == "v4":  # DeepSeek-V4's own fields, each alone: test_hf_config_v4
            continue
        if field.name == "dsa":  # DeepSeek sparse attention's, each alone: test_hf_config_dsa
            continue
        if field.name in ("swiglu_limit", "swiglu_alpha"):  # gpt-oss's; its sinks go with it (the key above)
            assert key(oss.replace(**{field.name: 3.5})) not in seen, field.name
            continue
        if field.name == "attention_sinks":
            continue
        if field.name in LLAMA4_FIELDS:  # Llama 4's, each changed alone on a Llama 4 model
            assert key(llama4.replace(**{field.name: LLAMA4_FIELDS[field.name]})) not in seen, field.name
            continue
        factors = field.name in ("rope_short_factor", "rope_long_factor")
        start = latent if field.name in LATENT_FIELDS else longrope if factors else \
            dynamic if field.name == "rope_max_position" else \
            base.replace(qk_norm=True) if field.name == "qk_norm_whole" else base
        changed = start.replace(**{field.name: _changed(start, field)})
        assert changed != start, field.name
        k = key(changed)
        assert k not in seen, f"changing {field.name} alone did not change the forward key"
        seen.add(k)


def test_dtype_override_changes_what_is_compiled(tmp_path, monkeypatch):
    """--dtype replaces the checkpoint's dtype in the job (and so in every forward key); weights are converted."""
    from flows.params import ExportParams, prepare
    from kiln.host.weights.checkpoint import random_checkpoint

    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    small = TINY.replace(num_layers=1, vocab_size=64)
    random_checkpoint(tmp_path / "ckpt", small)
    store = f"file://{tmp_path / 'store'}"

    def job_of(**extra):
        return prepare(ExportParams(model=str(tmp_path / "ckpt"), store=store, **extra), host_names=["h"],
                       signing=False)[0]

    plain, half = job_of(), job_of(dtype="bfloat16")
    assert plain.config["dtype"] == "float32" and half.config["dtype"] == "bfloat16"
    key = lambda j: j.specs(target="t", torch_version="v", code="c", compiler={})[0].key  # noqa: E731
    assert key(plain) != key(half)


QWEN3_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 128,
             "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16, "intermediate_size": 96, "num_local_experts": 8, "num_experts_per_tok": 2,
             "moe_intermediate_size": 32, "decoder_sparse_step": 1, "mlp_only_layers": [1]}


def test_mixture_of_experts_layers_are_chosen_as_transformers_chooses_them():
    cfg = from_hf(QWEN3_MOE)
    assert (cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size) == (8, 2, 32)
    assert cfg.moe_layers == (0, 2, 3) and cfg.qk_norm and not cfg.norm_topk_prob  # Qwen3MoeConfig's default
    assert from_hf({**QWEN3_MOE, "decoder_sparse_step": 2, "mlp_only_layers": []}).moe_layers == (1, 3)
    assert from_hf({**QWEN3_MOE, "num_local_experts": None, "num_experts": 16}).num_experts == 16
    mixtral = from_hf({**LLAMA, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral",
                       "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8})
    assert mixtral.moe_layers == tuple(range(mixtral.num_layers)) and mixtral.norm_topk_prob
    assert mixtral.moe_intermediate_size == mixtral.intermediate_size and mixtral.sliding_window == 8
    qwen2_moe = from_hf({**LLAMA, "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe",
                         "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                         "shared_expert_intermediate_size": 64, "use_sliding_window": False, "sliding_window": 0})
    # Qwen2MoeConfig's defaults: q/k/v biases, top-k not renormalised, every layer sparse; a shared expert.
    assert (qwen2_moe.qkv_bias, qwen2_moe.o_bias, qwen2_moe.norm_topk_prob, qwen2_moe.moe_layers) == \
        (True, False, False, (0, 1))
    assert qwen2_moe.shared_expert_intermediate_size == 64 and qwen2_moe.sliding_window is None
    without = {k: v for k, v in to_hf(qwen2_moe).items() if k != "shared_expert_intermediate_size"}
    assert from_hf(without).shared_expert_intermediate_size == 5632  # Qwen2MoeConfig's default width
    with pytest.raises(BadInput, match="shared_expert_intermediate_size=0 must be a positive integer"):
        from_hf({**without, "shared_expert_intermediate_size": 0})
    for cfg in (from_hf(QWEN3_MOE), mixtral, qwen2_moe):
        assert from_hf(to_hf(cfg)) == cfg
        assert ModelConfig(**json.loads(json.dumps(cfg.to_dict()))) == cfg  # as a forward key reads it back


@pytest.mark.parametrize("change, words", [
    ({"num_experts": 4}, "num_local_experts=8 and num_experts=4 disagree"),
    ({"num_experts_per_tok": 9}, "exceeds the 8 experts"),
    ({"decoder_sparse_step": 0}, "decoder_sparse_step=0 must be a positive integer"),
    ({"mlp_only_layers": "1"}, "mlp_only_layers='1' must list layer indices"),
    ({"norm_topk_prob": "yes"}, "norm_topk_prob='yes' must be true or false"),
    ({"shared_expert_intermediate_size": 64}, "shared_expert_intermediate_size=64"),
])
def test_mixture_of_experts_values_outside_what_kiln_computes_are_refused_by_name(change, words):
    with pytest.raises(BadInput, match=re.escape(words)):
        from_hf({**QWEN3_MOE, **change})


DEEPSEEK_V3 = {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "vocab_size": 256,
               "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 16, "num_hidden_layers": 4,
               "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 8, "n_group": 2,
               "topk_group": 1, "num_experts_per_tok": 2, "kv_lora_rank": 32, "q_lora_rank": 24,
               "qk_rope_head_dim": 8, "v_head_dim": 16, "qk_nope_head_dim": 16, "first_k_dense_replace": 1,
               "head_dim": 8, "qk_head_dim": 24, "torch_dtype": "bfloat16"}
"""A small DeepSeek-V3 as published configs spell it (the 4.x remote code's fields come in the tests below)."""


def test_deepseek_v3_reads_as_deepseekv3config_computes_it():
    """Field by field against transformers' own DeepseekV3Config: a small one as save_pretrained writes it
    (to_diff_dict: to_dict adds id2label, chunk_size_feed_forward, ... that no config.json holds), the
    defaults of a file that leaves every field out, and to_hf's file read back by DeepseekV3Config."""
    transformers = pytest.importorskip("transformers")
    sizes = {k: v for k, v in DEEPSEEK_V3.items() if k not in ("architectures", "model_type", "head_dim",
                                                                  "qk_head_dim", "torch_dtype")}
    hf = transformers.DeepseekV3Config(**sizes, n_shared_experts=2, attention_bias=True, routed_scaling_factor=1.5)
    cfg = from_hf(hf.to_diff_dict())
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.intermediate_size) \
        == (hf.vocab_size, hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads,
            hf.intermediate_size)
    assert (cfg.head_dim, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.rotated_dims, cfg.v_head_dim) == \
        (hf.qk_head_dim, hf.qk_nope_head_dim, hf.qk_rope_head_dim, hf.qk_rope_head_dim, hf.v_head_dim)
    assert (cfg.kv_lora_rank, cfg.q_lora_rank, cfg.rope_interleave) == (hf.kv_lora_rank, hf.q_lora_rank, True)
    assert (cfg.qkv_bias, cfg.o_bias, cfg.mlp_bias, cfg.qk_norm) == (False, True, False, False)
    assert (cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size, cfg.norm_topk_prob) == \
        (hf.n_routed_experts, hf.num_experts_per_tok, hf.moe_intermediate_size, hf.norm_topk_prob)
    assert cfg.moe_layers == tuple(i for i in range(hf.num_hidden_layers) if i >= hf.first_k_dense_replace)
    assert cfg.shared_expert_intermediate_size == hf.moe_intermediate_size * hf.n_shared_experts
    assert (cfg.router, cfg.num_expert_groups, cfg.topk_groups, cfg.routed_scaling_factor) == \
        ("sigmoid_groups", hf.n_group, hf.topk_group, hf.routed_scaling_factor)
    assert (cfg.rope_type, cfg.rope_theta, cfg.attn_scale_multiplier, cfg.rms_norm_eps, cfg.tie_word_embeddings) == \
        ("default", 10000.0, 1.0, hf.rms_norm_eps, hf.tie_word_embeddings)
    # A file that leaves every field out reads as DeepseekV3Config() does: DeepSeek-V3's own sizes.
    full = from_hf({"model_type": "deepseek_v3"})
    assert full == from_hf(transformers.DeepseekV3Config().to_diff_dict())
    assert (full.vocab_size, full.hidden_size, full.num_layers, full.head_dim, full.q_lora_rank, full.kv_lora_rank,
            full.num_experts, full.experts_per_token, full.moe_layers[0], full.routed_scaling_factor) == \
        (129280, 7168, 61, 192, 1536, 512, 256, 8, 3, 2.5)
    # DeepSeek-V3's published rope (4.x rope_scaling), as transformers 5 saves it again: rope_parameters.
    yarn = {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 64,
            "beta_fast": 32, "beta_slow": 1}
    scaled = transformers.DeepseekV3Config(**sizes, rope_scaling=yarn, max_position_embeddings=2560)
    assert from_hf(scaled.to_diff_dict()) == from_hf({**DEEPSEEK_V3, "rope_scaling": yarn, "torch_dtype": None})
    for c in (cfg, from_hf(DEEPSEEK_V3), from_hf(scaled.to_diff_dict())):
        assert from_hf(transformers.DeepseekV3Config(**to_hf(c)).to_diff_dict()) == c


def test_deepseek_v3_latent_attention_experts_and_yarn():
    cfg = from_hf(DEEPSEEK_V3)
    assert (cfg.head_dim, cfg.q_lora_rank, cfg.moe_layers, cfg.shared_expert_intermediate_size, cfg.dtype) == \
        (24, 24, (1, 2, 3), 16, "bfloat16")
    assert from_hf({**DEEPSEEK_V3, "q_lora_rank": None}).q_lora_rank == 0  # one q_proj
    assert from_hf({**DEEPSEEK_V3, "first_k_dense_replace": 3}).moe_layers == (3,)
    assert from_hf({**DEEPSEEK_V3, "first_k_dense_replace": 0, "moe_layer_freq": 2}).moe_layers == (0, 2)
    assert from_hf({**DEEPSEEK_V3, "n_shared_experts": None}).shared_expert_intermediate_size == 0
    assert from_hf({**DEEPSEEK_V3, "n_group": None, "topk_group": None}).num_expert_groups == 1
    no_kv_heads = {k: v for k, v in DEEPSEEK_V3.items() if k != "num_key_value_heads"}
    assert from_hf(no_kv_heads).num_kv_heads == 4  # every head reads the latent
    assert from_hf({**DEEPSEEK_V3, "n_routed_experts": None, "num_local_experts": 8}).num_experts == 8
    # DeepSeek-V3's published rope: yarn whose mscale_all_dim also scales the scores, by mscale squared.
    yarn = {"type": "yarn", "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0, "original_max_position_embeddings": 64,
            "beta_fast": 32, "beta_slow": 1}
    scaled = from_hf({**DEEPSEEK_V3, "rope_scaling": yarn, "max_position_embeddings": 2560})
    assert scaled.attn_scale_multiplier == pytest.approx((0.1 * math.log(40) + 1) ** 2)
    assert scaled.rope_attention_factor == 1.0  # mscale / mscale_all_dim
    half = from_hf({**DEEPSEEK_V3, "rope_scaling": {**yarn, "mscale_all_dim": 0.5}})
    assert half.attn_scale_multiplier == pytest.approx((0.05 * math.log(40) + 1) ** 2)
    assert from_hf({**DEEPSEEK_V3, "rope_scaling": {**yarn, "mscale_all_dim": 0}}).attn_scale_multiplier == 1.0
    published = {**DEEPSEEK_V3, "topk_method": "noaux_tc", "scoring_func": "sigmoid", "num_nextn_predict_layers": 1,
                 "ep_size": 1, "aux_loss_alpha": 0.001, "seq_aux": True, "moe_layer_freq": 1,
                 "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"}}
    assert from_hf(published) == cfg
    for c in (cfg, scaled, half, from_hf({**DEEPSEEK_V3, "q_lora_rank": None, "n_shared_experts": 0}),
              from_hf({**DEEPSEEK_V3, "first_k_dense_replace": 0, "moe_layer_freq": 2})):
        assert from_hf(to_hf(c)) == c


DEEPSEEK_V3_REFUSED = [
    ({"topk_method": "greedy"}, "topk_method='greedy'"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"quantization_config": {"activation_scheme": "static", "fmt": "e4m3", "quant_method": "fp8",
                              "weight_block_size": [128, 128]}}, "activation_scheme='static'"),
    ({"quantization_config": {"quant_method": "gptq"}}, "quantization_config"),
    ({"head_dim": 24}, "head_dim=24"),
    ({"qk_head_dim": 16}, "qk_head_dim=16"),
    ({"num_key_value_heads": 2}, "num_key_value_heads (2) must equal num_attention_heads (4)"),
    ({"n_routed_experts": 8, "num_local_experts": 16}, "disagree"),
    ({"q_lora_rank": 0}, "q_lora_rank=0"),
    ({"first_k_dense_replace": None}, "first_k_dense_replace=None"),
    ({"hidden_act": "gelu"}, "hidden_act='gelu'"),
    ({"mlp_bias": True}, "mlp_bias=True"),
]


@pytest.mark.parametrize("change,words", DEEPSEEK_V3_REFUSED, ids=[w for _, w in DEEPSEEK_V3_REFUSED])
def test_deepseek_v3_values_outside_what_kiln_computes_are_refused_by_name(change, words):
    with pytest.raises(BadInput, match="config.json") as err:
        from_hf({**DEEPSEEK_V3, **change})
    assert words in str(err.value)


def test_to_hf_refuses_what_no_config_of_the_family_has():
    deepseek = from_hf(DEEPSEEK_V3)
    for cfg, words in [
        (from_hf(LLAMA).replace(kv_lora_rank=8, qk_rope_head_dim=8, v_head_dim=16, num_kv_heads=4),
         "latent attention"),
        (from_hf(QWEN3_MOE).replace(router="sigmoid_groups"), "grouped sigmoid routing"),
        (deepseek.replace(kv_lora_rank=0, q_lora_rank=0, qk_rope_head_dim=0, v_head_dim=0, rope_interleave=False),
         "every deepseek_v3 config has latent attention"),
        (deepseek.replace(router="softmax"), "sigmoid_groups"),
        (deepseek.replace(moe_layers=(1, 3)), "first_k_dense_replace"),
        (deepseek.replace(attn_scale_multiplier=1.5), "yarn"),
        (deepseek.replace(sliding_window=8), "sliding window"),
    ]:
        with pytest.raises(BadInput, match=words):
            to_hf(cfg)


def test_configs_transformers_reads_its_own_way_are_computed_or_refused_as_it_does():
    """Two fields transformers 5.25 reads but computes otherwise than their names say: Gemma3Attention never
    applies attn_logit_softcapping (Kiln leaves it out too), and Qwen2MoeConfig without layer_types slides every
    other layer below max_window_layers (Kiln refuses that by name, and writes layer_types back)."""
    transformers = pytest.importorskip("transformers")
    capped = from_hf({**GEMMA3, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0})
    assert capped.attn_softcap is None and capped.final_softcap == 30.0
    assert from_hf({**GEMMA2, "attn_logit_softcapping": 50.0}).attn_softcap == 50.0  # Gemma 2 applies it
    moe = {**LLAMA, "architectures": ["Qwen2MoeForCausalLM"], "model_type": "qwen2_moe", "num_experts": 8,
           "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64,
           "num_hidden_layers": 4, "use_sliding_window": True, "sliding_window": 5, "max_window_layers": 2}
    with pytest.raises(BadInput, match="use_sliding_window without layer_types: Qwen2MoeConfig then slides every "
                                       "other layer below max_window_layers"):
        from_hf(moe)
    cfg = from_hf({**moe, "layer_types": ["full_attention"] * 2 + ["sliding_attention"] * 2})
    assert [cfg.window_of(i) for i in range(4)] == [None, None, 5, 5]
    written = to_hf(cfg)
    theirs = transformers.Qwen2MoeConfig(**{k: v for k, v in written.items() if k != "architectures"})
    assert theirs.layer_types == ["full_attention"] * 2 + ["sliding_attention"] * 2 and from_hf(written) == cfg
