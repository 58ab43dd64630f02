"""A compiled decode step reads its cached pages in place (kiln.host.model.layers.paged_attention) and computes what
the eager shard does, over a context of several pages in a shuffled block table and a sliding window.

The load runs in a subprocess (native code) that reports on its last line.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

CHECK = r"""
import json, sys
import torch
from kiln.core.model.config import ModelConfig
from kiln.core.plan.recipe import Bucket
from kiln.host.ranks.loader import compare_with_eager, load_forward, place_weights
from kiln.host.model import random_state_dict, shard_state_dict, solo_group

job = json.loads(sys.argv[1])
cfg = ModelConfig(**job["config"])
weights = place_weights(shard_state_dict(random_state_dict(cfg, seed=2), cfg, 1, 0), "cpu")
with solo_group():
    compiled = load_forward(job["path"], weights, job["sha256"])
    results = [compare_with_eager(compiled, cfg, 1, 0, weights, Bucket(2, 1), page_tokens=4, pages_per_seq=6,
                                  atol=1e-4, half_ratio=2.0, seed=seed) for seed in (1, 2, 3)]
print(json.dumps([r["diff"] for r in results]))
"""


def test_a_compiled_decode_step_reads_its_pages_in_place_as_eager_computes(tmp_path):
    from kiln.core.model.config import TINY
    from kiln.core.forwards.forward_keys import forward_spec
    from kiln.core.plan.recipe import Bucket
    from kiln.core.forwards.shape_ranges import static_shape
    from kiln.host.compile.compiler import CompilePool
    from kiln.host.compile.key_sources import model_code_fingerprint
    from kiln.host.compile.inductor_options import COMPILER_OPTIONS

    # 4 query heads over 2 KV heads (grouped), a window of 7 on the second layer: 24 cached positions.
    cfg = TINY.replace(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_size=128,
                       vocab_size=128, sliding_window=7, first_sliding_layer=1)
    spec = forward_spec(shapes=static_shape(Bucket(2, 1)), graph={"config": cfg.to_dict(), "tp": 1, "code": model_code_fingerprint()},
                        target="test", torch_version="test", page_tokens=4, pages_per_seq=6,
                        compiler=COMPILER_OPTIONS).to_dict()
    with CompilePool(1) as pool:
        [result] = pool.run([(spec, str(tmp_path / "decode.pt2"))], lambda r: None)
    job = {"config": cfg.to_dict(), "path": result.path, "sha256": result.sha256}
    proc = subprocess.run([sys.executable, "-c", CHECK, json.dumps(job)], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    diffs = json.loads(proc.stdout.strip().splitlines()[-1])
    assert max(diffs) <= 1e-4, diffs
