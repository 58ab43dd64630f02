"""An export runs without Kiln: every package loads in a fresh interpreter with torch alone.

`examples/torch_only.py` is the consumer a user would write from the manifest
alone. It runs here as two gloo ranks in fresh interpreters in which importing
Kiln is made impossible; their logits must match Kiln's own loader (the same
packages, weights bound by kiln.loader.load_forward from kiln.checkpoint) and
the unsharded eager model.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "torch_only.py"

# Run a script in an isolated interpreter (-I: no PYTHONPATH, no script folder on sys.path beyond the
# example's own) in which Kiln's packages cannot be imported, and prove afterwards that none was.
NO_KILN = r"""
import runpy, sys
BLOCKED = ("kiln", "flows", "tasks", "blocks", "bench")
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not available to a consumer of the export")
sys.meta_path.insert(0, Block())
script = sys.argv[1]
sys.argv = sys.argv[1:]
runpy.run_path(script, run_name="__main__")
leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
assert not leaked, leaked
print("TORCH-ONLY-OK", flush=True)
"""

# The same step through Kiln's loader, for comparison (rank per process, one gloo group).
KILN_STEP = r"""
import json, sys, os
from pathlib import Path
import torch, torch.distributed as dist
sys.path.insert(0, sys.argv[7])
from torch_only import step_inputs
from kiln.checkpoint import load_rank_weights
from kiln.config import ModelConfig
from kiln.loader import load_forward
manifest = json.loads(Path(sys.argv[1]).read_text())
packages, rank, world, port, out = Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], Path(sys.argv[6])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
side = dist.new_group(backend="gloo")
cfg = ModelConfig(**manifest["model"]["config"])
weights = load_rank_weights(manifest["model"]["checkpoint"], cfg, world, rank)
logits = {}
for f in manifest["forwards"]:
    compiled = load_forward(packages / f"{f['key']}.pt2", weights, f["sha256"])
    with torch.no_grad():
        logits[f["bucket"]] = compiled(*step_inputs(f, cfg.vocab_size))[0]
dist.barrier(group=side)
dist.destroy_process_group()
out.mkdir(parents=True, exist_ok=True)
torch.save(logits, out / f"rank{rank}.pt")
"""


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ranks(cmd_of, world: int) -> list[subprocess.CompletedProcess]:
    port = _free_port()
    procs = [subprocess.Popen(cmd_of(rank, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(world)]
    done = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done


@pytest.fixture(scope="module")
def manifest(tp2_export) -> tuple[dict, Path, Path]:
    r = tp2_export["cold_report"]
    root = Path(tp2_export["store"].removeprefix("file://"))
    path = root / r["manifest"]
    return json.loads(path.read_text()), path, root / "forwards"


def test_manifest_states_the_consumer_contract(manifest):
    m, _, _ = manifest
    assert m["runtime"] == {"process_group": "0", "world_size": 2, "python_free": True}
    assert m["forwards"] and all(f["python_free"] for f in m["forwards"])
    for f in m["forwards"]:
        ops = set(f["ops"])
        assert {"aoti_torch_cpu__c10d_functional_all_reduce_", "aoti_torch_cpu__c10d_functional_wait_tensor"} <= ops
        assert f["interface"]["process_group"] == "0"
        kv = next(i for i in f["interface"]["inputs"] if i["name"] == "kv_cache")
        assert "num_pages" in kv["shape"]
        assert set(f["constants"]) == set(m["weights"])
    q = m["weights"]["model.layers.0.self_attn.q_proj.weight"]
    assert q["cut"]["dim"] == 0 and q["cut"]["offsets"] == [0, q["cut"]["length"]]
    assert m["weights"]["model.norm.weight"]["cut"] is None


def test_every_package_runs_with_torch_alone_and_matches_kiln(manifest, tmp_path):
    import torch

    m, path, packages = manifest
    ckpt = m["model"]["checkpoint"]
    alone = _ranks(lambda rank, port: [
        sys.executable, "-I", "-c", NO_KILN, str(EXAMPLE), "--manifest", str(path), "--packages", str(packages),
        "--checkpoint", ckpt, "--rank", str(rank), "--world-size", "2", "--port", str(port),
        "--out", str(tmp_path / "alone")], 2)
    for p in alone:
        assert p.returncode == 0 and "TORCH-ONLY-OK" in p.stdout, p.stderr[-3000:]
    with_kiln = _ranks(lambda rank, port: [
        sys.executable, "-c", KILN_STEP, str(path), str(packages), str(rank), "2", str(port),
        str(tmp_path / "kiln"), str(EXAMPLE.parent)], 2)
    for p in with_kiln:
        assert p.returncode == 0, p.stderr[-3000:]

    from kiln.checkpoint import load_rank_weights
    from kiln.config import ModelConfig
    from kiln.model import ShardedDecoder
    sys.path.insert(0, str(EXAMPLE.parent))
    from torch_only import step_inputs

    cfg = ModelConfig(**m["model"]["config"])
    eager = ShardedDecoder(cfg, 1).eval()
    eager.load_state_dict(load_rank_weights(ckpt, cfg, 1, 0))
    got = [torch.load(tmp_path / "alone" / f"rank{r}.pt") for r in range(2)]
    ref = [torch.load(tmp_path / "kiln" / f"rank{r}.pt") for r in range(2)]
    assert set(got[0]) == {f["bucket"] for f in m["forwards"]}
    for f in m["forwards"]:
        b = f["bucket"]
        # Both ranks hold the whole logits after the all-reduce; they agree with each other and with Kiln.
        assert torch.equal(got[0][b], got[1][b])
        assert float((got[0][b] - ref[0][b]).abs().max()) <= 1e-6, b
        args = step_inputs(f, cfg.vocab_size)
        args[2] = torch.zeros(args[2].shape[:4] + (cfg.num_kv_heads, cfg.head_dim))  # all KV heads, empty
        with torch.no_grad():
            want = eager(*args)[0]
        assert float((got[0][b] - want).abs().max()) < 1e-4 * max(1.0, float(want.abs().max())), b
