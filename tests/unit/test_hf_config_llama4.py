"""Llama 4's text config.json as Llama4TextConfig reads it (kiln.core.model.hf_config.llama4), and its image-text
checkpoint's text_config (kiln.core.model.hf_config.multimodal)."""

from __future__ import annotations

import pytest

from kiln.core.errors import BadInput
from kiln.core.model.hf_config import from_hf, to_hf

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e '.[test]'")

SMALL = dict(vocab_size=512, hidden_size=128, intermediate_size=64, intermediate_size_mlp=256, num_hidden_layers=6,
             num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_local_experts=8, num_experts_per_tok=1,
             interleave_moe_layer_step=2, no_rope_layer_interval=3, attention_chunk_size=8)


def _written(**overrides) -> dict:
    """config.json as save_pretrained writes it for Llama4TextConfig(**overrides)."""
    return transformers.Llama4TextConfig(**overrides).to_diff_dict() | {"model_type": "llama4_text"}


def test_the_defaults_are_llama4_scouts():
    cfg, theirs = from_hf({"model_type": "llama4_text"}), transformers.Llama4TextConfig()
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.intermediate_size, cfg.moe_intermediate_size, cfg.num_experts, cfg.experts_per_token,
            cfg.rms_norm_eps, cfg.rope_theta, cfg.attention_chunk_size) == (
        theirs.vocab_size, theirs.hidden_size, theirs.num_hidden_layers, theirs.num_attention_heads,
        theirs.num_key_value_heads, theirs.head_dim, theirs.intermediate_size_mlp, theirs.intermediate_size,
        theirs.num_local_experts, theirs.num_experts_per_tok, theirs.rms_norm_eps,
        theirs.rope_parameters["rope_theta"], theirs.attention_chunk_size)
    assert cfg.nope_layers == tuple(i for i, rope in enumerate(theirs.no_rope_layers) if not rope)
    assert cfg.moe_layers == tuple(theirs.moe_layers)
    assert cfg.shared_expert_intermediate_size == theirs.intermediate_size
    assert (cfg.qk_l2_norm, cfg.temperature_floor, cfg.temperature_scale) == (
        theirs.use_qk_norm, theirs.floor_scale, theirs.attn_scale)
    assert cfg.router == "sigmoid_input" and not cfg.tie_word_embeddings


def test_what_save_pretrained_writes_reads_back_and_round_trips():
    theirs = transformers.Llama4TextConfig(**SMALL)
    cfg = from_hf(_written(**SMALL))
    assert cfg.nope_layers == (2, 5) and cfg.moe_layers == (1, 3, 5) == tuple(theirs.moe_layers)
    assert [("full_attention" if i in cfg.nope_layers else "chunked_attention") for i in range(6)] == theirs.layer_types
    assert from_hf(to_hf(cfg)) == cfg
    unchunked = from_hf(_written(**{**SMALL, "attention_chunk_size": None, "attn_temperature_tuning": False}))
    assert unchunked.attention_chunk_size is None and unchunked.temperature_floor == 0


def test_the_text_decoder_of_an_image_text_checkpoint_is_read():
    outer = transformers.Llama4Config(text_config=SMALL).to_diff_dict()
    outer = {**outer, "model_type": "llama4", "architectures": ["Llama4ForConditionalGeneration"]}
    cfg = from_hf(outer)
    assert cfg == from_hf(_written(**SMALL)) and not cfg.tie_word_embeddings


@pytest.mark.parametrize("change, words", [
    ({"layer_types": ["full_attention"] * 6}, "chunked attention exactly on the layers that rotate"),
    ({"no_rope_layers": [1, 1, 0]}, "for each of the 6 layers"),
    ({"hidden_act": "gelu"}, "silu"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, "fused 3-D experts"),
    ({"rope_parameters": {"rope_type": "mrope", "rope_theta": 1e4}}, "rope_type='mrope'"),
])
def test_what_kiln_does_not_compute_is_refused_by_name(change, words):
    with pytest.raises(BadInput, match=words):
        from_hf({**_written(**SMALL), **change})


def test_llama4s_own_fields_are_refused_on_another_family():
    from kiln.core.model.config import TINY
    with pytest.raises(BadInput, match="Llama 4's"):
        TINY.replace(attention_chunk_size=8)
