"""DeepSeek-V4's config.json read as transformers' DeepseekV4Config reads it, written back, and refused by name.

Expected values are DeepseekV4Config's (transformers 5.25), worked out by hand from its __post_init__.
"""

from __future__ import annotations

import dataclasses

import pytest

from kiln.core.model.cache_layout import cache_layout
from kiln.core.model.config import ModelConfig
from kiln.core.model.contract import constant_shapes
from kiln.core.plan.decisions import page_size
from kiln.core.errors import BadInput
from kiln.core.model.hf_config import from_hf, to_hf
from kiln.core.model.interface import forward_interface
from kiln.core.plan.job import ExportJob
from kiln.core.model.layer_runs import layer_runs
from kiln.core.plan.recipe import Recipe
from kiln.core.model.v4_fields import CSA, HCA, SLIDING, V4Fields

SMALL = {"model_type": "deepseek_v4", "architectures": ["DeepseekV4ForCausalLM"], "vocab_size": 256,
         "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 6, "num_attention_heads": 4,
         "head_dim": 32, "q_lora_rank": 32, "n_routed_experts": 8, "num_experts_per_tok": 2, "o_groups": 2,
         "o_lora_rank": 16, "index_n_heads": 4, "index_head_dim": 16, "index_topk": 3,
         "partial_rotary_factor": 0.25, "sliding_window": 8}


def test_defaults_read_as_deepseekv4config_sets_them():
    full = from_hf({"model_type": "deepseek_v4"})  # V4-Flash's sizes
    v4 = full.v4
    assert (full.num_layers, full.num_heads, full.num_kv_heads, full.head_dim, full.qk_rope_head_dim) == \
        (43, 64, 1, 512, 64)
    assert v4.layer_types[:4] == (HCA, HCA, HCA, CSA) and v4.layer_types[-1] == HCA
    assert v4.mlp_layer_types[:4] == ("hash_moe",) * 3 + ("moe",)
    assert (v4.csa_rate, v4.hca_rate, v4.hc_mult, v4.hc_sinkhorn_iters, v4.index_topk) == (4, 128, 4, 20, 512)
    assert (full.rope_theta, v4.main_rope_theta, full.rope_type) == (160000.0, 10000.0, "default")
    assert (full.router, full.routed_scaling_factor, full.num_experts, full.experts_per_token) == \
        ("sqrtsoftplus", 1.5, 256, 6)


def test_legacy_spellings_fold_in():
    cfg = from_hf({**SMALL, "partial_rotary_factor": None, "qk_rope_head_dim": 16, "num_hash_layers": 1,
                   "compress_ratios": [0, 4, 128, 4, 128, 0, 4], "compress_rate_hca": 16})
    assert cfg.qk_rope_head_dim == 16
    assert cfg.v4.layer_types == (SLIDING, CSA, HCA, CSA, HCA, SLIDING)  # cut to num_hidden_layers
    assert cfg.v4.mlp_layer_types == ("hash_moe",) + ("moe",) * 5
    assert (cfg.v4.csa_rate, cfg.v4.hca_rate) == (4, 16)


def test_the_two_ropes():
    yarn = {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64, "beta_fast": 32,
            "beta_slow": 1}
    for spelled in ({"rope_parameters": yarn}, {"rope_scaling": yarn}):
        cfg = from_hf({**SMALL, **spelled, "compress_rope_theta": 5000.0, "rope_theta": 50.0})
        assert (cfg.rope_type, cfg.rope_theta, cfg.rope_factor, cfg.rope_attention_factor) == \
            ("yarn", 5000.0, 16.0, 1.0)
        assert cfg.v4.main_rope_theta == 50.0
    nested = {"main": {"rope_type": "default", "rope_theta": 10.0, "partial_rotary_factor": 0.25},
              "compress": {**yarn, "rope_theta": 7.0, "partial_rotary_factor": 0.25, "attention_factor": 1.0}}
    cfg = from_hf({**SMALL, "rope_parameters": nested})
    assert (cfg.v4.main_rope_theta, cfg.rope_theta, cfg.rope_type) == (10.0, 7.0, "yarn")
    with pytest.raises(BadInput, match="rope_parameters.main"):
        from_hf({**SMALL, "rope_parameters": {**nested, "main": {**yarn, "rope_theta": 10.0}}})


def test_to_hf_round_trips():
    for raw in (SMALL, {**SMALL, "rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 64},
                        "layer_types": [SLIDING, CSA, HCA, CSA, CSA, SLIDING], "tie_word_embeddings": True}):
        cfg = from_hf(raw)
        assert from_hf(to_hf(cfg)) == cfg
        assert ModelConfig(**cfg.to_dict()) == cfg


V4_REFUSED = [
    ({"n_shared_experts": 2}, "n_shared_experts=2"),
    ({"scoring_func": "softmax"}, "scoring_func='softmax'"),
    ({"norm_topk_prob": False}, "norm_topk_prob=False"),
    ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
    ({"layer_types": [SLIDING] * 5}, "layer_types="),
    ({"layer_types": ["full_attention"] * 6}, "full_attention"),
    ({"compress_ratios": [0, 4, 64, 4, 4, 4]}, "compress_ratios="),
    ({"qk_rope_head_dim": 16}, "qk_rope_head_dim=16"),
    ({"o_groups": 3}, "o_groups (3)"),
    ({"hc_fancy": 1}, "hc_fancy=1"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "expert_dtype": "fp4"}},
     "FP4 experts come with UE8M0 scales"),
    ({"expert_dtype": "fp4"}, "expert_dtype='fp4' without a quantization_config"),
    ({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128], "scale_fmt": "ue8m0",
                              "expert_dtype": "fp4"}, "expert_dtype": "fp8"}, "one checkpoint has one format"),
    ({"quantization_config": {"quant_method": "mxfp4"}}, "quant_method='mxfp4'"),
]


@pytest.mark.parametrize("change,words", V4_REFUSED, ids=[w for _, w in V4_REFUSED])
def test_values_outside_what_kiln_computes_are_refused_by_name(change, words):
    with pytest.raises(BadInput, match=words.replace("(", r"\(").replace(")", r"\)")):
        from_hf({**SMALL, **change})


def test_every_v4_field_is_in_the_forward_key():
    def key(cfg: ModelConfig) -> str:
        job = ExportJob(export_id="k", model_name="m", checkpoint="/none", config=cfg.to_dict(), tp=1,
                        recipe=Recipe(), store_url="file:///none")
        return job.specs(target="t", torch_version="v", code="c", compiler={})[0].key

    base = from_hf(SMALL)
    seen = {key(base)}
    special = {"layer_types": (SLIDING,) * 6, "mlp_layer_types": ("moe",) * 6, "hc_eps": 1e-3}
    for field in dataclasses.fields(V4Fields):
        value = getattr(base.v4, field.name)
        new = special.get(field.name, value * 2)
        k = key(base.replace(v4=dataclasses.replace(base.v4, **{field.name: new})))
        assert k not in seen, f"changing v4.{field.name} alone did not change the forward key"
        seen.add(k)


def test_tp_splits_heads_groups_and_experts_and_names_what_works():
    cfg = from_hf(SMALL)
    cfg.check_tp(2)
    with pytest.raises(BadInput, match=r"--tp 3 cannot split the model: it has 2 output groups \(o_groups\), "
                                       r"fewer than 3 ranks; use a tp of 1, 2\."):
        cfg.check_tp(3)
    shapes = constant_shapes(cfg, 2)
    assert shapes["model.runs.0.attn.wq_b.weight"][1:] == (2 * 32, 32)  # 2 of 4 heads
    assert shapes["model.runs.0.attn.attn_sink"][1:] == (2,)
    assert shapes["model.runs.0.attn.wo_b.weight"][1:] == (64, 16)  # 1 of 2 groups
    assert shapes["model.runs.0.attn.wkv.weight"][1:] == (32, 64)  # the one key=value head, whole


def test_runs_are_layers_of_one_kind():
    cfg = from_hf({**SMALL, "layer_types": [SLIDING, CSA, CSA, HCA, HCA, HCA],
                   "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe", "moe", "moe"]})
    assert layer_runs(cfg) == [range(0, 1), range(1, 2), range(2, 3), range(3, 6)]


def test_the_cache_a_layer_keeps_and_what_a_token_adds():
    """kiln.core.model.v4_fields.layer_state: a window of sliding_window rows on every layer; a compressed layer's
    entries (one per rate tokens) and the projections a coming entry needs; a CSA layer's indexer too."""
    from kiln.core.model.v4_fields import layer_state

    cfg = from_hf({**SMALL, "layer_types": [SLIDING, CSA, CSA, HCA, HCA, HCA],
                   "compress_rates": {CSA: 4, HCA: 8}})
    assert layer_state(cfg, SLIDING, 100) == {"window": (8, 32)}
    assert layer_state(cfg, HCA, 100) == {"window": (8, 32), "entries": (13, 32), "ring_kv": (8, 32),
                                          "ring_gate": (8, 32)}
    assert layer_state(cfg, CSA, 100) == {"window": (8, 32), "entries": (25, 32), "ring_kv": (8, 64),
                                          "ring_gate": (8, 64), "index_entries": (25, 16),
                                          "index_ring_kv": (8, 32), "index_ring_gate": (8, 32)}
    layout = cache_layout(cfg, 1, 96)
    assert layout.values_per_token(cfg.num_layers) == 2 * (32 + 16) / 4 + 3 * 32 / 8
    assert layout.values_per_sequence() == 6 * 8 * 32 + 2 * (2 * 8 * 64 + 2 * 8 * 32) + 3 * 2 * 8 * 32


V3_LIKE = {**SMALL, "layer_types": [SLIDING, CSA, CSA, HCA, HCA, HCA], "compress_rates": {CSA: 4, HCA: 8},
           "mlp_layer_types": ["hash_moe", "hash_moe", "moe", "moe", "moe", "moe"]}


def test_the_slot_cache_lists_every_state_of_every_run_in_order():
    """contract.cache_layout of DeepSeek-V4: one slot per sequence holding each run's state tensors
    [layers, rows, width] back to back; the compressed entries grow one row per rate tokens, the window
    and rings are fixed; every rank holds the same (replicated)."""
    cfg = from_hf(V3_LIKE)
    layout = cache_layout(cfg, 2, 64)
    assert not layout.paged and not layout.sharded and layout.capacity_tokens == 64
    got = [(s.run, s.name, (s.layers, s.rows, s.width), s.tokens_per_row) for s in layout.states]
    assert got == [(0, "window", (1, 8, 32), None),
                   (1, "window", (1, 8, 32), None), (1, "entries", (1, 16, 32), 4), (1, "ring_kv", (1, 8, 64), None),
                   (1, "ring_gate", (1, 8, 64), None), (1, "index_entries", (1, 16, 16), 4),
                   (1, "index_ring_kv", (1, 8, 32), None), (1, "index_ring_gate", (1, 8, 32), None),
                   (2, "window", (1, 8, 32), None), (2, "entries", (1, 16, 32), 4), (2, "ring_kv", (1, 8, 64), None),
                   (2, "ring_gate", (1, 8, 64), None), (2, "index_entries", (1, 16, 16), 4),
                   (2, "index_ring_kv", (1, 8, 32), None), (2, "index_ring_gate", (1, 8, 32), None),
                   (3, "window", (3, 8, 32), None), (3, "entries", (3, 8, 32), 8), (3, "ring_kv", (3, 8, 32), None),
                   (3, "ring_gate", (3, 8, 32), None)]
    assert {s.run: s.model_layers for s in layout.states} == {j: tuple(r) for j, r in enumerate(layer_runs(cfg))}
    offsets = [s.offset for s in layout.states]
    assert offsets == [sum(s.values for s in layout.states[:i]) for i in range(len(offsets))]
    assert layout.slot_values == layout.values_per_sequence() + 64 * layout.values_per_token(cfg.num_layers)
    assert layout.shape(6, 5, 16) == [5, layout.slot_values] and layout.new_shape(6, 3, 16) == [3, layout.slot_values]
    assert cache_layout(cfg, 1, 64) == layout  # replicated: the same at every tp
    assert cache_layout(cfg, 1, 128).slot_values == layout.slot_values + 64 * (2 * (32 + 16) // 4 + 3 * 32 // 8)
    with pytest.raises(ValueError, match="context_tokens"):
        cache_layout(cfg, 1)


def test_a_v4_forward_interface_names_its_slots_and_states():
    cfg = from_hf(V3_LIKE)
    spec = {"batch": [1, 4], "tokens": [16, 16], "page_tokens": 16, "pages_per_seq": 4}
    face = forward_interface(cfg, 2, spec)
    slot = cache_layout(cfg, 2, 64).slot_values
    assert [(a["name"], a["shape"]) for a in face["inputs"]] == [
        ("tokens", ["batch", 16]), ("start_pos", ["batch"]), ("kv_cache", ["num_slots", slot]), ("slots", ["batch"])]
    csa = [i for i, kind in enumerate(cfg.v4.layer_types) if kind == "compressed_sparse_attention"]
    topk = [i for i, kind in enumerate(cfg.v4.mlp_layer_types) if kind == "moe"]
    assert csa and topk  # both choice outputs are there
    assert [(a["name"], a["shape"]) for a in face["outputs"]] == [
        ("logits", ["batch", 16, 256]), ("new_kv", ["batch", slot]),
        ("expert_choices", [len(topk), "batch", 16, cfg.experts_per_token]),
        ("indexer_picks", [len(csa), "batch", 16, min(cfg.v4.index_topk, 64 // cfg.v4.csa_rate)])]
    assert {a["dtype"] for a in face["outputs"][2:]} == {"int32"}
    assert face["dynamic_dims"] == {"num_slots": {"min": 2}, "batch": {"min": 1, "max": 4}}
    cache = face["kv_cache"]
    assert cache["slot_values"] == slot and cache["sharded"] is False and cache["capacity_tokens"] == 64
    assert [s["name"] for s in cache["states"] if s["tokens_per_row"]] == ["entries", "index_entries"] * 2 + ["entries"]


def test_the_kv_plan_counts_a_v4_slot_over_its_pages_and_v4_caches_less_than_v3():
    """The plan's page of a slot cache is a slot over pages_per_seq (pages / pages_per_seq are slots); what a
    token adds at DeepseekV4Config's defaults against DeepSeek-V3's latent over as many layers."""
    cfg = from_hf(V3_LIKE)
    recipe = Recipe(page_tokens=16, max_context_tokens=64)
    job = ExportJob(export_id="k", model_name="m", checkpoint="/none", config=cfg.to_dict(), tp=1, recipe=recipe,
                    store_url="file:///none")
    slot = cache_layout(cfg, 1, 64).slot_values * 4  # float32
    assert page_size(job) == -(-slot // 4) and page_size(job) * 4 >= slot
    full = from_hf({"model_type": "deepseek_v4"})
    v4 = cache_layout(full, 1, 4096).values_per_token(full.num_layers)
    v3 = from_hf({"model_type": "deepseek_v3", "num_hidden_layers": full.num_layers})
    latent = cache_layout(v3, 1).values_per_token(v3.num_layers)
    assert (v4, latent) == (20 * (512 + 128) / 4 + 23 * 512 / 128, 43 * 576)
    assert latent / v4 > 7


def test_a_slot_width_gives_back_a_context_with_the_same_states():
    from kiln.core.model.cache_layout import slot_context

    cfg = from_hf(V3_LIKE)
    for context in (0, 1, 7, 8, 64, 100):
        layout = cache_layout(cfg, 1, context)
        assert cache_layout(cfg, 1, slot_context(cfg, layout.slot_values)).states == layout.states
    with pytest.raises(ValueError, match="no context"):
        slot_context(cfg, cache_layout(cfg, 1, 8).slot_values + 1)


def test_a_v4_export_needs_a_one_token_bucket_and_static_shapes():
    from kiln.core.plan.recipe import parse_buckets
    from kiln.core.model.v4_fields import export_refusal

    assert export_refusal(Recipe(buckets=parse_buckets("1x1,1x8"), shape_policy="static")) is None
    why = export_refusal(Recipe(buckets=parse_buckets("1x8,2x8"), shape_policy="static"))
    assert "a bucket of 1 token" in why and "--set buckets=1x1,1x8,2x8" in why and "static" not in why.split(";")[0][-9:]
    why = export_refusal(Recipe(buckets=parse_buckets("1x1,2x1,4x1")))
    assert "1 token" not in why and "2-4x1" in why and "--set shape_policy=static" in why
