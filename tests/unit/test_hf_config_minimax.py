"""MiniMax-M2's config.json as MiniMaxM2Config reads it (kiln.core.model.hf_config.minimax), and the tp its q/k
norms over all heads allow."""

from __future__ import annotations

import pytest

from kiln.core.errors import BadInput
from kiln.core.model.hf_config import from_hf, to_hf

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e '.[test]'")


def _written(**overrides) -> dict:
    """config.json as transformers' save_pretrained writes it for MiniMaxM2Config(**overrides)."""
    return transformers.MiniMaxM2Config(**overrides).to_diff_dict() | {"model_type": "minimax_m2"}


def test_the_defaults_are_minimax_m2s_and_its_published_rotary_dim_reads_as_transformers_reads_it():
    cfg = from_hf({"model_type": "minimax_m2", "rotary_dim": 64})
    theirs = transformers.MiniMaxM2Config(rotary_dim=64)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
            cfg.num_experts, cfg.experts_per_token, cfg.moe_intermediate_size) == (
        theirs.vocab_size, theirs.hidden_size, theirs.num_hidden_layers, theirs.num_attention_heads,
        theirs.num_key_value_heads, theirs.head_dim, theirs.num_local_experts, theirs.num_experts_per_tok,
        theirs.intermediate_size)
    assert cfg.rotary_dim == int(theirs.head_dim * theirs.rope_parameters["partial_rotary_factor"]) == 64
    assert cfg.rope_theta == theirs.rope_parameters["rope_theta"] == 5e6
    assert cfg.qk_norm and cfg.qk_norm_whole and cfg.router == "sigmoid_groups" and cfg.num_expert_groups == 1
    assert cfg.moe_layers == tuple(range(62)) and not cfg.tie_word_embeddings


def test_what_save_pretrained_writes_reads_back_and_round_trips():
    raw = _written(num_hidden_layers=3, hidden_size=128, head_dim=32, rotary_dim=16, num_local_experts=8,
                   num_experts_per_tok=2, intermediate_size=64, vocab_size=512)
    cfg = from_hf(raw)
    assert cfg.rotary_dim == 16 and cfg.num_experts == 8 and cfg.num_layers == 3
    assert from_hf(to_hf(cfg)) == cfg


@pytest.mark.parametrize("raw, words", [
    ({"rotary_dim": 64, "partial_rotary_factor": 0.25}, "disagree"),
    ({"rotary_dim": 63}, "even number of dims"),
    ({"hidden_act": "gelu"}, "silu only"),
    ({"use_routing_bias": False}, "use_routing_bias=False: Kiln does not compute"),
])
def test_what_kiln_does_not_compute_is_refused_by_name(raw, words):
    with pytest.raises(BadInput, match=words):
        from_hf({"model_type": "minimax_m2", **raw})


def test_tp_may_not_hold_a_key_head_twice():
    cfg = from_hf({"model_type": "minimax_m2", "num_key_value_heads": 2, "num_attention_heads": 8})
    cfg.check_tp(2)
    with pytest.raises(BadInput, match="k_norm normalises all 2 key/value heads together"):
        cfg.check_tp(4)
