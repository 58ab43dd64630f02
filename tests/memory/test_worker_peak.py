"""A compile worker's memory depends on the graph, not on the weights: it never materializes them."""

from __future__ import annotations

import pytest

from kiln.core.model.config import TINY
from kiln.core.model.rank_bytes import weight_bytes_per_rank
from kiln.host.compile.compiler import CompilePool
from kiln.host.compile.inductor_options import COMPILER_OPTIONS

pytestmark = pytest.mark.slow


def spec(cfg, key):
    return {"key": key, "shapes": "1x16", "graph": {"config": cfg.to_dict(), "tp": 2},
            "inputs": {"batch": [1, 1], "tokens": [16, 16], "hint": [1, 16], "page_tokens": 16, "pages_per_seq": 4},
            "compiler": COMPILER_OPTIONS}


def test_ten_times_the_weights_costs_a_worker_about_nothing(tmp_path):
    # ~30x the parameters; its rank's float32 weights alone (~390 MiB) would break the 1.3x bound.
    big = TINY.replace(vocab_size=32000, hidden_size=1024, intermediate_size=4096, num_layers=4,
                       num_heads=32, num_kv_heads=16, head_dim=32)
    assert big.num_params() > 25 * TINY.num_params()
    results = {}
    with CompilePool(1) as pool:  # one warm worker compiles both, one after the other
        for name, cfg in (("small", TINY), ("big", big)):
            [results[name]] = pool.run([(spec(cfg, name), str(tmp_path / f"{name}.pt2"))], lambda r: None)
    small, large = results["small"].peak_mib, results["big"].peak_mib
    weights_mib = weight_bytes_per_rank(big, 2) / 2**20
    print(f"worker peak: tiny {small} MiB, {big.num_params() / 1e6:.0f} M parameters {large} MiB "
          f"(its rank's weights: {weights_mib:.0f} MiB)")
    assert small > 100
    assert weights_mib > 0.3 * small, "materialized weights alone would break the bound: the test could fail"
    assert large <= 1.3 * small
