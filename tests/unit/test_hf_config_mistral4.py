"""Mistral 4's config.json as Mistral4Config reads it (kiln.core.model.hf_config.mistral4)."""

from __future__ import annotations

import pytest

from kiln.core.errors import BadInput
from kiln.core.model.hf_config import from_hf, to_hf

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e '.[test]'")

SMALL = dict(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, n_routed_experts=8, kv_lora_rank=64, q_lora_rank=48, qk_rope_head_dim=32,
             qk_nope_head_dim=64, v_head_dim=64, n_group=2, topk_group=1, num_experts_per_tok=2,
             first_k_dense_replace=1, max_position_embeddings=512)


def _written(**overrides) -> dict:
    """config.json as save_pretrained writes it for Mistral4Config(**overrides)."""
    return transformers.Mistral4Config(**overrides).to_diff_dict() | {"model_type": "mistral4"}


def test_the_defaults_are_mistral4s():
    cfg, theirs = from_hf({"model_type": "mistral4"}), transformers.Mistral4Config()
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.kv_lora_rank, cfg.q_lora_rank,
            cfg.qk_rope_head_dim, cfg.v_head_dim, cfg.num_experts, cfg.experts_per_token) == (
        theirs.vocab_size, theirs.hidden_size, theirs.num_hidden_layers, theirs.num_attention_heads,
        theirs.kv_lora_rank, theirs.q_lora_rank, theirs.qk_rope_head_dim, theirs.v_head_dim, theirs.n_routed_experts,
        theirs.num_experts_per_tok)
    rope = theirs.rope_parameters
    assert cfg.head_dim == theirs.head_dim and cfg.num_kv_heads == cfg.num_heads
    assert (cfg.rope_type, cfg.rope_factor, cfg.rope_original_max_position, cfg.query_scale_beta) == (
        "yarn", rope["factor"], rope["original_max_position_embeddings"], rope["llama_4_scaling_beta"])
    assert cfg.router == "softmax_groups" and cfg.moe_layers == tuple(range(36)) and cfg.rope_interleave
    from transformers.modeling_rope_utils import yarn_apply_mscale
    assert cfg.attn_scale_multiplier == pytest.approx(yarn_apply_mscale(rope, 1.0), rel=1e-12) != 1.0


def test_what_save_pretrained_writes_reads_back_and_round_trips():
    cfg = from_hf(_written(**SMALL))
    assert cfg.num_experts == 8 and cfg.moe_layers == (1, 2) and cfg.shared_expert_intermediate_size == 32
    assert from_hf(to_hf(cfg)) == cfg


@pytest.mark.parametrize("change, words", [
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4}}, "llama_4_scaling_beta"),
    ({"head_dim": 32}, "qk_nope_head_dim \\+ qk_rope_head_dim \\(96\\)"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}, "fused 3-D experts"),
])
def test_what_kiln_does_not_compute_is_refused_by_name(change, words):
    with pytest.raises(BadInput, match=words):
        from_hf({**_written(**SMALL), **change})
