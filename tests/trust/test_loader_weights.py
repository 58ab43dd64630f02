"""The loader refuses weights the package was not compiled for, naming the tensor, before loading any.

Each load runs in a fresh interpreter (native code; AOTInductor loads a
package once per process) that prints what happened as JSON.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow

LOAD = r"""
import json, sys
import torch
from kiln.core.model.config import ModelConfig
from kiln.core.errors import UnloadablePackage
from kiln.host.ranks.loader import load_forward
from kiln.host.model import ShardedDecoder

job = json.loads(sys.argv[1])
cfg = ModelConfig(**job["config"])
weights = dict(ShardedDecoder(cfg, 1).eval().state_dict())
name = "model.runs.0.self_attn.q_proj.weight"  # stacked: [layers, rows, hidden]
if job["change"] == "dtype":
    weights[name] = weights[name].to(torch.bfloat16)
elif job["change"] == "shape":
    weights[name] = weights[name][:, :-1].contiguous()
elif job["change"] == "missing":
    del weights[name]
try:
    load_forward(job["path"], weights, job["sha256"])
    print(json.dumps({"refused": None}))
except UnloadablePackage as exc:
    print(json.dumps({"refused": str(exc)}))
"""


@pytest.mark.parametrize("change,words", [
    ("dtype", "weight model.runs.0.self_attn.q_proj.weight is bfloat16 [1, 64, 64] but the package was compiled "
              "for float32 [1, 64, 64]"),
    ("shape", "weight model.runs.0.self_attn.q_proj.weight is float32 [1, 63, 64] but the package was compiled "
              "for float32 [1, 64, 64]"),
    ("missing", "needs 1 constant(s) that no rank's weights provide (model.runs.0.self_attn.q_proj.weight): "
                "the rank's weights lack them"),
    ("none", None),
])
def test_weights_that_do_not_fit_are_refused_by_name(small_forward, change, words):
    job = {**small_forward, "change": change}
    proc = subprocess.run([sys.executable, "-c", LOAD, json.dumps(job)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    refused = json.loads(proc.stdout.strip().splitlines()[-1])["refused"]
    if words is None:
        assert refused is None
    else:
        assert refused is not None and words in refused


SHARED = r"""
import json, sys
import torch
from kiln.core.model.config import ModelConfig
from kiln.host.ranks.loader import load_forward, place_weights
from kiln.host.model import ShardedDecoder, example_inputs

job = json.loads(sys.argv[1])
cfg = ModelConfig(**job["config"])
weights = place_weights(dict(ShardedDecoder(cfg, 1).eval().state_dict()), "cpu")
a, b = (load_forward(job["path"], weights, job["sha256"]) for _ in range(2))
args = example_inputs(cfg, 1, job["batch"], job["tokens"], page_tokens=job["page_tokens"],
                      pages_per_seq=job["pages_per_seq"], num_pages=job["pages_per_seq"] + 1)
with torch.no_grad():
    before = a(*args)[0].clone()
    same = bool(torch.equal(before, b(*args)[0]))
    weights["model.norm.weight"].mul_(2.0)  # in place: a package that kept a copy would not see it
    after_a, after_b = a(*args)[0], b(*args)[0]
print(json.dumps({"same": same, "a_sees": not torch.equal(before, after_a), "b_sees": not torch.equal(before, after_b),
                  "user_managed": a.kiln_user_managed}))
"""


def test_every_package_of_a_rank_reads_the_one_copy_of_its_weights(small_forward):
    """Two packages loaded with one rank's weights hold no copy: a change to the caller's tensors reaches both."""
    proc = subprocess.run([sys.executable, "-c", SHARED, json.dumps(small_forward)], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"same": True, "a_sees": True, "b_sees": True, "user_managed": True}
