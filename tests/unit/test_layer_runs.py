"""kiln.core.model.layer_runs: which layers one scan runs, where kinds repeat one at a time or in a pattern."""

from __future__ import annotations

import pytest

from kiln.core.model.hf_config import from_hf
from kiln.core.model.layer_runs import MAX_PERIOD, Segment, layer_runs, segments, segments_of


@pytest.mark.parametrize("kinds,want", [
    ("", []),
    ("A", [Segment(0, 1, 1)]),
    ("AAAA", [Segment(0, 4, 1)]),
    ("AAB", [Segment(0, 2, 1), Segment(2, 3, 1)]),
    ("ABAB", [Segment(0, 4, 2)]),
    ("ABA", [Segment(0, 1, 1), Segment(1, 2, 1), Segment(2, 3, 1)]),  # a pattern seen once is no loop
    ("AAABCBCBCB", [Segment(0, 3, 1), Segment(3, 9, 2), Segment(9, 10, 1)]),  # the module docstring's
    ("AABAAB", [Segment(0, 6, 3)]),
    ("AAAAB", [Segment(0, 4, 1), Segment(4, 5, 1)]),  # period 1 wins a tie with AA AA
    ("ABCDEABCDE", [Segment(i, i + 1, 1) for i in range(10)]),  # a pattern longer than MAX_PERIOD
])
def test_segments_cover_every_layer_once_in_order(kinds, want):
    got = segments_of(list(kinds))
    assert got == want
    layers = sorted(i for s in got for run in s.runs() for i in run)
    assert layers == list(range(len(kinds)))
    for s in got:  # every run holds layers of one kind
        assert all(len({kinds[i] for i in run}) == 1 for run in s.runs())
        assert s.period <= MAX_PERIOD and (s.stop - s.start) == s.repeats * s.period


def test_the_published_deepseek_v4_schedule_is_three_segments_whatever_its_depth():
    """DeepseekV4Config's default: HCA, HCA, then HCA and CSA in turn; the first three layers hash-routed.
    43 layers (V4-Flash): three hash-routed HCA layers, then 40 alternating CSA and HCA: 3 runs, not 41."""
    base = dict(model_type="deepseek_v4", vocab_size=512, hidden_size=128, num_attention_heads=4, head_dim=64,
                q_lora_rank=48, moe_intermediate_size=48, n_routed_experts=8, num_experts_per_tok=2,
                o_groups=2, o_lora_rank=32, index_n_heads=4, index_head_dim=32)
    cfg = from_hf({**base, "num_hidden_layers": 43})
    assert segments(cfg) == [Segment(0, 3, 1), Segment(3, 43, 2)]
    runs = layer_runs(cfg)
    assert runs == [range(0, 3), range(3, 43, 2), range(4, 43, 2)]
    assert {cfg.v4.kind(i) for i in runs[1]} == {cfg.v4.kind(3)} != {cfg.v4.kind(4)} == {cfg.v4.kind(i) for i in runs[2]}
    assert len(layer_runs(from_hf({**base, "num_hidden_layers": 16}))) == 4  # 13 alternating: 6 pairs and one


def test_qwen3_moe_every_other_layer_sparse_is_one_segment():
    cfg = from_hf(dict(model_type="qwen3_moe", vocab_size=512, hidden_size=64, intermediate_size=128,
                       num_hidden_layers=8, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                       num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=2))
    assert segments(cfg) == [Segment(0, 8, 2)]
    assert [cfg.is_moe(run[0]) for run in layer_runs(cfg)] == [False, True]
