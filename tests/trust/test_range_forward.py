"""One package over a range of shapes computes what eager computes at the shapes a check compares, and only
within the range.

The session's `small_forward` is compiled once over batch 2-3 and tokens 4-8
for 3x6 (kiln.core.forwards.shape_ranges); a fresh interpreter loads it (native code)
with random weights and compares it with the eager model at the range's four
corners, its hint and an interior shape (ShapeRange.checked_shapes), then calls it just
outside each bound, where the package must refuse the call.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

CORNERS = r"""
import json, os, sys
os.environ["AOTI_RUNTIME_CHECK_INPUTS"] = "1"
import torch
from kiln.core.model.config import ModelConfig
from kiln.core.plan.recipe import Bucket
from kiln.host.ranks.loader import compare_with_eager, load_forward
from kiln.host.model import ShardedDecoder, example_inputs

job = json.loads(sys.argv[1])
cfg = ModelConfig(**job["config"])
torch.manual_seed(5)
weights = dict(ShardedDecoder(cfg, 1).eval().state_dict())
compiled = load_forward(job["path"], weights, job["sha256"])
out = {"diff": {}, "outside": {}}
for b, t in job["checked"]:
    out["diff"][f"{b}x{t}"] = compare_with_eager(compiled, cfg, 1, 0, weights, Bucket(b, t), page_tokens=16,
                                                 pages_per_seq=4, atol=1e-3, half_ratio=2.0)["diff"]
for b, t in [[1, 6], [4, 6], [3, 3], [3, 9]]:
    try:
        compiled(*example_inputs(cfg, 1, b, t, page_tokens=16, pages_per_seq=4, num_pages=6))
        out["outside"][f"{b}x{t}"] = "ran"
    except RuntimeError as exc:
        out["outside"][f"{b}x{t}"] = str(exc).splitlines()[0]
print(json.dumps(out))
"""


def test_a_range_package_matches_eager_at_its_checked_shapes_and_refuses_shapes_outside(small_forward):
    proc = subprocess.run([sys.executable, "-c", CORNERS, json.dumps(small_forward)], capture_output=True,
                          text=True, timeout=600)
    last = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    assert proc.returncode == 0 and last.startswith("{"), proc.stderr[-3000:]
    out = json.loads(last)
    assert small_forward["shapes"] == "2-3x4-8@3x6"
    assert set(out["diff"]) == {"2x4", "2x5", "2x8", "3x4", "3x6", "3x8"}
    assert max(out["diff"].values()) < 1e-5, out["diff"]
    assert out["outside"] == {"1x6": "input_handles[0]: dim value is too small at 0, expected it to be >= 2, but got: 1",
                              "4x6": "input_handles[0]: dim value is too large at 0, expected to be <= 3, but got: 4",
                              "3x3": "input_handles[0]: dim value is too small at 1, expected it to be >= 4, but got: 3",
                              "3x9": "input_handles[0]: dim value is too large at 1, expected to be <= 8, but got: 9"}
