"""Running an export's packages as two gloo ranks without Kiln, and the same step through Kiln's loader.

`examples/torch_only.py` is the consumer a user would write from the manifest
alone; `run_torch_only` runs it in fresh interpreters in which importing Kiln
is made impossible, `run_with_kiln` runs the same step through
kiln.host.ranks.loader.load_forward. Both leave `{bucket: logits}` in OUT/rank{r}.pt.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
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
from torch_only import choose_forward, step_inputs
from kiln.host.weights.checkpoint import load_rank_weights
from kiln.core.model.config import ModelConfig
from kiln.host.ranks.loader import load_forward
manifest = json.loads(Path(sys.argv[1]).read_text())
packages, rank, world, port, out = Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], Path(sys.argv[6])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
side = dist.new_group(backend="gloo")
cfg = ModelConfig(**manifest["model"]["config"])
weights = load_rank_weights(manifest["model"]["checkpoint"], cfg, world, rank)
logits, loaded = {}, {}
for bucket in manifest["buckets"]:
    batch, tokens = map(int, bucket.split("x"))
    f = choose_forward([f for f in manifest["forwards"] if rank in f.get("ranks", [rank])], batch, tokens)
    if f["key"] not in loaded:
        loaded[f["key"]] = load_forward(packages / f["object"].removeprefix("forwards/"), weights, f["sha256"])
    with torch.no_grad():
        logits[bucket] = loaded[f["key"]](*step_inputs(f, cfg.vocab_size, batch, tokens))[0]
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


def _ranks(cmd_of, world: int, ranks: tuple[int, ...] | None = None) -> list[subprocess.CompletedProcess]:
    port = _free_port()
    procs = [subprocess.Popen(cmd_of(rank, port), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in (range(world) if ranks is None else ranks)]
    done = []
    for p in procs:
        out, err = p.communicate(timeout=600)
        done.append(subprocess.CompletedProcess(p.args, p.returncode, out, err))
    return done



def torch_only_ranks(manifest_path: Path, packages: Path, checkpoint: str, out: Path, world: int = 2,
                     extra: tuple[str, ...] = (), ranks: tuple[int, ...] | None = None
                     ) -> list[subprocess.CompletedProcess]:
    """The example's ranks (`ranks`, default all `world`), Kiln unimportable; `extra`: more flags (--verify-key
    FILE, ...). A rank alone is enough to see a refusal: the example refuses before it joins the others."""
    return _ranks(lambda rank, port: [
        sys.executable, "-I", "-c", NO_KILN, str(EXAMPLE), "--manifest", str(manifest_path), "--packages",
        str(packages), "--checkpoint", checkpoint, "--rank", str(rank), "--world-size", str(world), "--port",
        str(port), "--out", str(out), *extra], world, ranks)


def run_torch_only(manifest_path: Path, packages: Path, checkpoint: str, out: Path, world: int = 2, *,
                   verify_key: Path) -> None:
    """The example's ranks, trusting the public key in `verify_key` to have signed the manifest."""
    for p in torch_only_ranks(manifest_path, packages, checkpoint, out, world, ("--verify-key", str(verify_key))):
        assert p.returncode == 0 and "TORCH-ONLY-OK" in p.stdout, p.stderr[-3000:]


def run_with_kiln(manifest_path: Path, packages: Path, out: Path, world: int = 2) -> None:
    done = _ranks(lambda rank, port: [
        sys.executable, "-c", KILN_STEP, str(manifest_path), str(packages), str(rank), str(world), str(port),
        str(out), str(EXAMPLE.parent)], world)
    for p in done:
        assert p.returncode == 0, p.stderr[-3000:]
