"""kiln.core.model.shares: what each of tp ranks holds, for any tp, and which tp is refused (pure).

The model's own check that ranks of these shares compute what transformers computes is
tests/reference/test_uneven_tp.py; here, the split rule at real sizes (Llama-3.1-8B, DeepSeek-V4-Flash) and
the contract's cuts of every tensor across the ranks.
"""

from __future__ import annotations

import math

import pytest
from test_hf_config_v4 import SMALL

from kiln.core.errors import BadInput
from kiln.core.model.cache_layout import cache_layout
from kiln.core.model.config import TINY, ModelConfig
from kiln.core.model.contract import constant_shapes, parameter_shapes, rank_reads, shard_slice
from kiln.core.model.hf_config import from_hf
from kiln.core.model.param_counts import params_per_rank
from kiln.core.model.rank_bytes import weight_bytes_per_rank
from kiln.core.model.shares import even, rank_share, split

LLAMA_8B = ModelConfig(vocab_size=128256, hidden_size=4096, num_layers=2, num_heads=32, num_kv_heads=8,
                       head_dim=128, intermediate_size=14336)
"""Llama-3.1-8B's widths (two layers: depth does not change a split)."""
FLASH = from_hf({"model_type": "deepseek_v4", "num_hidden_layers": 4, "expert_dtype": "fp4",
                 "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                         "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}})
"""DeepSeek-V4-Flash as published (transformers' DeepseekV4Config defaults: 64 heads in 8 output groups,
256 experts of 2048, FP8 attention and shared expert, FP4 routed experts), four layers."""


def _counts(cfg, tp):
    return [rank_share(cfg, tp, r).counts() for r in range(tp)]


def test_split_is_contiguous_near_equal_and_in_whole_units():
    assert split(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert split(14336, 3) == [(0, 4779), (4779, 9558), (9558, 14336)]
    assert split(2048, 3, 128) == [(0, 768), (768, 1408), (1408, 2048)]
    assert split(1000, 3, 128) == [(0, 384), (384, 768), (768, 1000)]  # the last ends in a partial unit
    for count, parts, unit in ((7, 7, 1), (100, 6, 1), (4096, 5, 32), (24, 4, 1)):
        spans = split(count, parts, unit)
        assert spans[0][0] == 0 and spans[-1][1] == count
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        sizes = [b - a for a, b in spans]
        assert max(sizes) - min(sizes) <= unit and all(a % unit == 0 for a, _ in spans)


def test_an_even_tp_gives_every_rank_the_old_equal_share():
    for tp in (1, 2, 3, 4, 6):
        counts = _counts(TINY, tp)
        assert even(TINY, tp) and counts == [counts[0]] * tp
        assert (counts[0]["heads"], counts[0]["kv_heads"], counts[0]["mlp"]) == (24 // tp, 12 // tp, 1152 // tp)
        assert constant_shapes(TINY, tp, tp - 1) == constant_shapes(TINY, tp, 0)


def test_llama_8b_at_tp_3_splits_whole_kv_groups():
    counts = _counts(LLAMA_8B, 3)
    assert [(c["heads"], c["kv_heads"], c["mlp"]) for c in counts] == [(12, 3, 4779), (12, 3, 4779), (8, 2, 4778)]
    assert not even(LLAMA_8B, 3) and all("kv_runs" not in c for c in counts)
    shapes = [constant_shapes(LLAMA_8B, 3, r) for r in range(3)]
    assert [s["model.runs.0.self_attn.q_proj.weight"] for s in shapes] == [(2, 1536, 4096)] * 2 + [(2, 1024, 4096)]
    assert [s["model.runs.0.mlp.down_proj.weight"] for s in shapes] == [(2, 4096, 4779)] * 2 + [(2, 4096, 4778)]
    assert [cache_layout(LLAMA_8B, 3, rank=r).heads for r in range(3)] == [3, 3, 2]
    # at tp 5, 6 and 7 too (8 KV heads): and at tp 16, 32, each rank's query heads inside one KV group
    for tp in (5, 6, 7, 16, 32):
        assert sum(c["heads"] for c in _counts(LLAMA_8B, tp)) == 32
    assert {c["kv_heads"] for c in _counts(LLAMA_8B, 16)} == {1} and "kv_runs" not in _counts(LLAMA_8B, 16)[0]


def test_fewer_kv_heads_than_ranks_split_the_query_heads_and_hold_the_kv_heads_they_use():
    cfg = LLAMA_8B.replace(num_heads=8, num_kv_heads=2, hidden_size=1024)
    shares = [rank_share(cfg, 3, r) for r in range(3)]
    assert [s.heads for s in shares] == [(0, 3), (3, 6), (6, 8)]
    assert [s.kv_heads for s in shares] == [(0, 1), (0, 2), (1, 2)]  # KV head 0 on ranks 0, 1; head 1 on 1, 2
    assert [s.kv_runs for s in shares] == [None, (1, 2), None]  # rank 1: query 3 -> KV 0, queries 4, 5 -> KV 1
    reads = rank_reads(cfg, 3, 1)["model.runs.0.self_attn.k_proj.weight"]
    assert [cut for _, cut in reads] == [(0, 0, 256)] * 2  # both KV heads' rows, each layer


@pytest.mark.parametrize("tp", [2, 3, 5, 6, 7])
def test_the_ranks_cuts_partition_every_split_tensor(tp):
    """Every split tensor's ranks' cuts tile it exactly (KV heads apart where ranks share one); every other
    tensor is whole on every rank."""
    for cfg in (LLAMA_8B, LLAMA_8B.replace(num_kv_heads=32), FLASH, from_hf({**SMALL, "num_attention_heads": 8,
                                                                                "o_groups": 8})):
        if tp > (cfg.v4.o_groups if cfg.v4 else cfg.num_heads):
            continue
        for name, shape in parameter_shapes(cfg).items():
            cuts = [shard_slice(name, cfg, tp, r) for r in range(tp)]
            if cuts[0] is None:
                assert all(c is None for c in cuts), name
                continue
            dim = cuts[0][0]
            assert all(c[0] == dim for c in cuts), name
            if cfg.num_kv_heads < tp and (".k_proj." in name or ".v_proj." in name):
                continue
            assert cuts[0][1] == 0 and cuts[-1][2] == shape[dim], (name, cuts)
            assert all(a[2] == b[1] for a, b in zip(cuts, cuts[1:])), (name, cuts)


def test_v4_flash_at_tp_3_splits_output_groups_and_keeps_whole_blocks():
    """The incident's export: 8 output groups of 8 heads go 3, 3, 2; every rank's FP8 rows and columns and
    FP4 scale groups are whole (a rank's scales are the checkpoint's own, no sub-block repeats)."""
    counts = _counts(FLASH, 3)
    assert [(c["groups"], c["heads"]) for c in counts] == [(3, 24), (3, 24), (2, 16)]
    assert [c["experts"] for c in counts] == [704, 672, 672]  # FP4: whole 32-input groups, not 683
    assert [c["shared"] for c in counts] == [768, 640, 640]  # FP8: whole 128-column blocks
    for r in range(3):
        for name, sources in rank_reads(FLASH, 3, r).items():
            for _, cut in sources:
                assert cut is None or len(cut) == 3, (name, cut)  # no (dim, start, stop, repeat)
    bytes_ = [sum(math.prod(s) for s in constant_shapes(FLASH, 3, r).values()) for r in range(3)]
    assert bytes_[0] == max(bytes_) and bytes_[2] < bytes_[1] < bytes_[0]


def test_what_a_rank_weighs_bounds_every_rank():
    """The gate's and the KV plan's figures read rank 0's share, which holds the most: exact for rank 0, above
    every other rank."""
    for cfg, tp in ((LLAMA_8B, 3), (TINY, 5), (LLAMA_8B.replace(num_heads=8, num_kv_heads=2), 3)):
        per_rank = [sum(math.prod(s) for s in constant_shapes(cfg, tp, r).values()) for r in range(tp)]
        assert params_per_rank(cfg, tp) >= max(per_rank)
        assert params_per_rank(cfg, tp) - max(per_rank) <= cfg.num_layers * cfg.hidden_size * cfg.head_dim * 2
    held = [sum(math.prod(s) for s in constant_shapes(FLASH, 3, r).values()) for r in range(3)]
    assert weight_bytes_per_rank(FLASH, 3) > weight_bytes_per_rank(FLASH, 4) and held[0] == max(held)


def test_a_tp_without_a_whole_unit_for_every_rank_is_refused_naming_the_ones_that_work():
    with pytest.raises(BadInput, match=r"--tp 33 cannot split the model: it has 32 attention heads, fewer than 33 "
                                       r"ranks; use a tp of 1, 2, .*, 32\."):
        LLAMA_8B.check_tp(33)
    with pytest.raises(BadInput, match=r"it has 8 output groups \(o_groups\), fewer than 9 ranks; use a tp of "
                                       r"1, 2, 3, 4, 5, 6, 7, 8\."):
        FLASH.check_tp(9)
    small_heads = from_hf({**SMALL, "num_attention_heads": 8, "o_groups": 4,
                           "quantization_config": {
                               "quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                               "weight_block_size": [128, 128], "scale_fmt": "ue8m0"}, "moe_intermediate_size": 384})
    with pytest.raises(BadInput, match=r"unequal shares of attn\.wq_b\.weight cut inside its 128-entry quantization "
                                       r"blocks \(32 entries per head\); use a tp of 1, 2, 4\."):
        small_heads.check_tp(3)
    with pytest.raises(BadInput, match=r"--tp must be a positive integer, got 0\."):
        TINY.check_tp(0)


def test_an_uneven_tp_makes_a_forward_per_rank_shape_and_an_even_one_keeps_its_keys():
    from kiln.core.forwards.shape_ranges import parse_buckets
    from kiln.core.plan.job import ExportJob
    from kiln.core.plan.recipe import Recipe

    def specs(cfg, tp):
        job = ExportJob(export_id="e", model_name="m", checkpoint="/none", config=cfg.to_dict(), tp=tp,
                        recipe=Recipe(buckets=parse_buckets("1x8,2x4")), store_url="file:///tmp/s")
        return job.specs(target="cpu-x", torch_version="2.13.0", code="c", compiler={})

    even_specs = specs(TINY, 2)
    assert all("share" not in s.graph for s in even_specs)  # the keys of every export before uneven shares
    uneven = specs(TINY, 5)  # KV heads 3, 3, 2, 2, 2: two rank shapes
    assert len(uneven) == 2 * len(even_specs) and len({s.key for s in uneven}) == len(uneven)
    assert sorted(tuple(s.graph["share"]["ranks"]) for s in uneven) == [(0, 1)] * 2 + [(2, 3, 4)] * 2
    assert {(s.graph["share"]["heads"], s.graph["share"]["kv_heads"]) for s in uneven} == {(6, 3), (4, 2)}


def test_the_consumer_layout_states_each_ranks_shapes_where_they_differ():
    from kiln.core.model.contract import weight_layout

    layout = weight_layout(LLAMA_8B, 3)
    q = layout["model.runs.0.self_attn.q_proj.weight"]
    assert "shape" not in q and q["shapes"] == [[2, 1536, 4096], [2, 1536, 4096], [2, 1024, 4096]]
    cut = q["sources"][0]["cut"]
    assert "length" not in cut and cut["lengths"] == [1536, 1536, 1024] and cut["offsets"] == [0, 1536, 3072]
    assert layout["model.embed_tokens.weight"]["shape"] == [128256, 4096]  # whole on every rank: the even form
    even = weight_layout(LLAMA_8B, 2)["model.runs.0.self_attn.q_proj.weight"]
    assert even["shape"] == [2, 2048, 4096] and even["sources"][0]["cut"]["length"] == 2048
