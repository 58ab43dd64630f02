"""DeepSeek-V3.2's and GLM-5's config.json as DeepseekV32Config and GlmMoeDsaConfig read them
(kiln.core.model.hf_config.dsa), and each of DeepSeek sparse attention's fields in the forward key."""

from __future__ import annotations

import pytest

from kiln.core.errors import BadInput
from kiln.core.model.dsa_fields import DsaFields
from kiln.core.model.hf_config import from_hf, to_hf

transformers = pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e '.[test]'")

CLASSES = {"deepseek_v32": "DeepseekV32Config", "glm_moe_dsa": "GlmMoeDsaConfig"}
SMALL = dict(vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, kv_lora_rank=64, q_lora_rank=48,
             qk_rope_head_dim=32, qk_nope_head_dim=64, v_head_dim=64, n_group=2, topk_group=1, num_experts_per_tok=2,
             first_k_dense_replace=1, index_topk=4, index_head_dim=48, index_n_heads=8)


def _written(family: str, **overrides) -> dict:
    """config.json as save_pretrained writes it for the family's config class."""
    return getattr(transformers, CLASSES[family])(**overrides).to_diff_dict() | {"model_type": family}


@pytest.mark.parametrize("family", sorted(CLASSES))
def test_the_defaults_are_the_config_class_defaults(family):
    cfg, theirs = from_hf({"model_type": family}), getattr(transformers, CLASSES[family])()
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.kv_lora_rank, cfg.q_lora_rank,
            cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.num_experts, cfg.experts_per_token,
            cfg.num_expert_groups, cfg.topk_groups, cfg.rms_norm_eps, cfg.intermediate_size) == (
        theirs.vocab_size, theirs.hidden_size, theirs.num_hidden_layers, theirs.num_attention_heads,
        theirs.kv_lora_rank, theirs.q_lora_rank, theirs.qk_rope_head_dim, theirs.qk_nope_head_dim, theirs.v_head_dim,
        theirs.n_routed_experts, theirs.num_experts_per_tok, theirs.n_group, theirs.topk_group, theirs.rms_norm_eps,
        theirs.intermediate_size)
    assert cfg.dsa == DsaFields(theirs.index_n_heads, theirs.index_head_dim, theirs.index_topk,
                                family == "glm_moe_dsa")
    assert cfg.moe_layers == tuple(i for i, t in enumerate(theirs.mlp_layer_types) if t == "sparse")
    assert cfg.rope_interleave and cfg.router == "sigmoid_groups"


@pytest.mark.parametrize("family", sorted(CLASSES))
def test_what_save_pretrained_writes_reads_back_and_round_trips(family):
    cfg = from_hf(_written(family, **SMALL))
    assert cfg.moe_layers == (1, 2) and cfg.dsa.index_topk == 4 and cfg.head_dim == 96
    assert from_hf(to_hf(cfg)) == cfg
    mixed = from_hf(_written(family, **{**SMALL, "mlp_layer_types": ["sparse", "dense", "sparse"]}))
    assert mixed.moe_layers == (0, 2)


@pytest.mark.parametrize("family, change, words", [
    ("glm_moe_dsa", {"indexer_types": ["full", "shared", "full"]}, "cross-layer sharing"),
    ("glm_moe_dsa", {"indexer_types": None, "index_topk_freq": 2}, "'shared'"),
    ("deepseek_v32", {"layer_types": ["full_attention"] * 3}, "indexed_attention"),
    ("deepseek_v32", {"q_lora_rank": None}, "q_lora_rank"),
    ("deepseek_v32", {"rope_interleave": False}, "interleaved pairs"),
    ("deepseek_v32", {"index_topk": 0}, "index_topk"),
    ("deepseek_v32", {"mlp_layer_types": ["dense", "moe", "sparse"]}, "'dense' or 'sparse'"),
    ("glm_moe_dsa", {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}},
     "lightning indexer"),
])
def test_what_kiln_does_not_compute_is_refused_by_name(family, change, words):
    with pytest.raises(BadInput, match=words):
        from_hf({**_written(family, **SMALL), **change})


def test_each_indexer_field_is_in_the_forward_key():
    from kiln.core.plan.job import ExportJob
    from kiln.core.plan.recipe import Recipe

    def key(cfg) -> str:
        job = ExportJob(export_id="k", model_name="m", checkpoint="/none", config=cfg.to_dict(), tp=1,
                        recipe=Recipe(), store_url="file:///none")
        return job.specs(target="t", torch_version="v", code="c", compiler={})[0].key

    cfg = from_hf(_written("deepseek_v32", **SMALL))
    changed = [cfg.replace(dsa=DsaFields(**{**cfg.dsa.__dict__, field: value}))
               for field, value in (("index_heads", 4), ("index_head_dim", 64), ("index_topk", 8),
                                    ("rope_interleave", True))]
    assert len({key(c) for c in [cfg, *changed]}) == 5
