"""An image-text checkpoint's config.json read as its text decoder's (kiln.core.model.hf_config.multimodal), held to
transformers' config classes: their defaults, their fields, and which head they tie."""

from __future__ import annotations

import pytest

from kiln.core.errors import BadInput
from kiln.core.model.hf_config import from_hf
from kiln.core.model.hf_config.multimodal import TEXT_DEFAULTS, WRAPPERS, decoder_names, stored_name, text_tensors

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e '.[test]'")

TEXT_CLASSES = {"gemma3_text": "Gemma3TextConfig", "mistral": "MistralConfig", "llama": "LlamaConfig",
                "deepseek_v3": "DeepseekV3Config"}
WRAPPER_CLASSES = {"gemma3": "Gemma3Config", "mistral3": "Mistral3Config", "llava": "LlavaConfig",
                   "kimi_k25": "Kimi_K25Config", "llama4": "Llama4Config"}
GEMMA3_4B = {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
             "boi_token_index": 255999, "eoi_token_index": 256000, "eos_token_id": [1, 106],
             "image_token_index": 262144, "initializer_range": 0.02, "mm_tokens_per_image": 256,
             "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                             "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                             "sliding_window": 1024},
             "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
             "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
                               "model_type": "siglip_vision_model", "num_attention_heads": 16,
                               "num_hidden_layers": 27, "patch_size": 14, "vision_use_head": False}}
"""Gemma 3 4B's config.json as published: text_config lists only what differs from Gemma3TextConfig."""


@pytest.mark.parametrize("text_type", sorted(TEXT_DEFAULTS))
def test_the_text_defaults_are_the_text_config_class_defaults(text_type):
    defaults = getattr(transformers, TEXT_CLASSES[text_type])()
    for key, value in TEXT_DEFAULTS[text_type].items():
        assert getattr(defaults, key) == value, key


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_every_field_transformers_writes_for_the_wrapper_is_known_and_its_head_ties_as_transformers_ties(name):
    cls = getattr(transformers, WRAPPER_CLASSES[name])
    declared = {k for k in cls.__annotations__ if not k.startswith("_")}  # the class's own fields
    assert declared | set(cls.attribute_map) <= WRAPPERS[name].fields, declared - WRAPPERS[name].fields
    assert cls().tie_word_embeddings == WRAPPERS[name].tie_word_embeddings
    assert cls.model_type == name


def test_a_published_gemma3_config_reads_as_transformers_reads_its_text_config():
    cfg = from_hf(GEMMA3_4B)
    text = transformers.Gemma3Config.from_dict(GEMMA3_4B).text_config
    assert cfg.architecture == "gemma3_text" and cfg.dtype == "bfloat16" and cfg.tie_word_embeddings
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (
        text.vocab_size, text.hidden_size, text.num_hidden_layers, text.num_attention_heads,
        text.num_key_value_heads, text.head_dim)
    assert cfg.sliding_window == 1024 and cfg.full_attention_layers == tuple(
        i for i, t in enumerate(text.layer_types) if t == "full_attention")
    assert (cfg.rope_type, cfg.rope_factor) == ("linear", 8.0)


def test_the_outer_config_ties_the_head_not_the_text_config():
    untied = {**GEMMA3_4B, "tie_word_embeddings": False,
              "text_config": {**GEMMA3_4B["text_config"], "tie_word_embeddings": True}}
    assert not from_hf(untied).tie_word_embeddings
    assert not transformers.Gemma3Config.from_dict(untied).tie_word_embeddings
    kimi = {"model_type": "kimi_k25", "text_config": {"model_type": "kimi_k2", "tie_word_embeddings": False,
                                                      "num_hidden_layers": 4, "first_k_dense_replace": 1}}
    cfg = from_hf(kimi)
    assert cfg.architecture == "deepseek_v3" and cfg.tie_word_embeddings  # Kimi_K25Config ties by default
    assert cfg.hidden_size == transformers.DeepseekV3Config().hidden_size


@pytest.mark.parametrize("raw, words", [
    ({"model_type": "qwen3_5", "text_config": {}}, "text decoder is qwen3_5_text, which Kiln does not export yet"),
    ({"model_type": "gemma4", "text_config": {}}, "gemma4_text"),
    ({"model_type": "qwen2_5_vl", "text_config": {}}, r"multimodal rope \(mrope\)"),
    ({**GEMMA3_4B, "vision_soft_tokens": 3}, "vision_soft_tokens: Kiln does not know what this field changes in a "
                                             "gemma3 checkpoint"),
    ({k: v for k, v in GEMMA3_4B.items() if k != "text_config"}, "described by text_config, which is missing"),
    ({**GEMMA3_4B, "architectures": ["Gemma3ForCausalLM"]}, "Kiln exports the text decoder of "
                                                            "Gemma3ForConditionalGeneration"),
    ({**GEMMA3_4B, "text_config": {**GEMMA3_4B["text_config"], "use_bidirectional_attention": True}},
     "causal decoders only"),
])
def test_what_kiln_cannot_export_is_refused_by_name(raw, words):
    with pytest.raises(BadInput, match=words):
        from_hf(raw)


def test_both_layouts_name_the_same_decoder_and_the_rest_is_left_out():
    saved = ["language_model.model.embed_tokens.weight", "language_model.lm_head.weight",
             "vision_tower.encoder.layers.0.fc1.weight", "multi_modal_projector.linear_1.weight"]
    in_memory = ["model.language_model.embed_tokens.weight", "lm_head.weight",
                 "model.vision_tower.encoder.layers.0.fc1.weight", "model.multi_modal_projector.linear_1.weight"]
    for names in (saved, in_memory):
        mapped, left_out = decoder_names(names)
        assert sorted(mapped.values()) == ["lm_head.weight", "model.embed_tokens.weight"]
        assert left_out == sorted(names[2:])
    tensors = {n: 10 for n in saved}
    view, stored, said = text_tensors({"model_type": "llava", "text_config": {}}, tensors, lambda t: t * 2**20)
    assert sorted(view) == ["lm_head.weight", "model.embed_tokens.weight"]
    assert "left out 2 tensors (20.0 MiB: multi_modal_projector, vision_tower)" in said["left_out"]
    for name, old in stored.items():
        assert stored_name(name, said["prefixes"]) == old
    assert text_tensors({"model_type": "llama"}, tensors, len) == (tensors, {}, None)
    with pytest.raises(BadInput, match="holds both"):
        text_tensors({"model_type": "llava"}, {**tensors, "lm_head.weight": 1}, lambda t: t)
