"""An export runs without Kiln: every package loads in a fresh interpreter with torch alone.

`examples/torch_only.py` is the consumer a user would write from the manifest
alone. It runs here as two gloo ranks in fresh interpreters in which importing
Kiln is made impossible; their logits must match Kiln's own loader (the same
packages, weights bound by kiln.host.ranks.loader.load_forward from kiln.host.weights.checkpoint) and
the unsharded eager model.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from torch_only_harness import EXAMPLE, run_torch_only, run_with_kiln

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def manifest(tp2_export) -> tuple[dict, Path, Path]:
    r = tp2_export["cold_report"]
    root = Path(tp2_export["store"].removeprefix("file://"))
    path = root / r["manifest"]
    return json.loads(path.read_text()), path, root / "forwards"


def test_manifest_states_the_consumer_contract(manifest):
    m, _, _ = manifest
    assert m["runtime"] == {"process_group": "0", "world_size": 2, "python_free": True, "device": "cpu"}
    assert m["forwards"] and all(f["python_free"] for f in m["forwards"])
    for f in m["forwards"]:
        ops = set(f["ops"])
        assert {"aoti_torch_cpu__c10d_functional_all_reduce_", "aoti_torch_cpu__c10d_functional_wait_tensor"} <= ops
        assert f["interface"]["process_group"] == "0"
        kv = next(i for i in f["interface"]["inputs"] if i["name"] == "kv_cache")
        assert "num_pages" in kv["shape"]
        assert set(f["constants"]) == set(m["weights"])
    q = m["weights"]["model.runs.0.self_attn.q_proj.weight"]
    layers = m["model"]["config"]["num_layers"]
    assert q["stack"] == layers and q["shape"][0] == layers
    assert [s["tensor"] for s in q["sources"]] == [f"model.layers.{i}.self_attn.q_proj.weight" for i in range(layers)]
    assert all(s["cut"]["dim"] == 0 and s["cut"]["offsets"] == [0, s["cut"]["length"]] for s in q["sources"])
    norm = m["weights"]["model.norm.weight"]
    assert norm["stack"] is None and norm["sources"][0]["cut"] is None


def test_every_package_runs_with_torch_alone_and_matches_kiln(manifest, tmp_path):
    import torch

    m, path, packages = manifest
    ckpt = m["model"]["checkpoint"]
    run_torch_only(path, packages, ckpt, tmp_path / "alone")
    run_with_kiln(path, packages, tmp_path / "kiln")

    from kiln.core.model.config import ModelConfig
    from kiln.host.weights.checkpoint import load_rank_weights
    from kiln.host.model import ShardedDecoder
    sys.path.insert(0, str(EXAMPLE.parent))
    from torch_only import choose_forward, step_inputs

    cfg = ModelConfig(**m["model"]["config"])
    eager = ShardedDecoder(cfg, 1).eval()
    eager.load_state_dict(load_rank_weights(ckpt, cfg, 1, 0))
    got = [torch.load(tmp_path / "alone" / f"rank{r}.pt") for r in range(2)]
    ref = [torch.load(tmp_path / "kiln" / f"rank{r}.pt") for r in range(2)]
    assert set(got[0]) == set(m["buckets"]) and len(m["forwards"]) < len(m["buckets"])  # ranges serve them
    for b in m["buckets"]:
        batch, tokens = map(int, b.split("x"))
        f = choose_forward(m["forwards"], batch, tokens)
        # Both ranks hold the whole logits after the all-reduce; they agree with each other and with Kiln.
        assert torch.equal(got[0][b], got[1][b])
        assert float((got[0][b] - ref[0][b]).abs().max()) <= 1e-6, b
        args = step_inputs(f, cfg.vocab_size, batch, tokens)
        args[2] = torch.zeros(args[2].shape[:4] + (cfg.num_kv_heads, cfg.head_dim))  # all KV heads, empty
        with torch.no_grad():
            want = eager(*args)[0]
        assert float((got[0][b] - want).abs().max()) < 1e-4 * max(1.0, float(want.abs().max())), b
