"""The device check's ranks: tp 2 as two gloo ranks on one device, and rank 0 alone under NCCL, torch-only.

`gloo_ranks`: two spawned processes (kiln.host.ranks.verify_ranks.spawn_ranks) on
the same device, each loading the tp 2 package with its shard through
kiln.host.ranks.loader; rank 0 gathers both ranks' logits (on the CPU, in a side
group) and compares them with each other and with the unsharded eager model.
gloo takes CUDA tensors, so two ranks may share one GPU (NCCL refuses that).

`torch_only_rank0`: rank 0's package, weights and inputs run by a script that
imports torch alone, in a fresh isolated interpreter (`python -I`) where
Kiln cannot be imported, under a one-rank group of the given backend: whether
the package's all-reduce runs with nothing but libtorch behind it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def _rank(rank: int, tp: int, rendezvous: str, job: dict, link) -> dict:
    import torch
    import torch.distributed as dist

    from kiln.core.model.config import ModelConfig
    from kiln.device_check.hf_llama import prefill_args
    from kiln.host.weights.checkpoint import load_rank_weights
    from kiln.host.ranks.loader import eager_outputs, load_forward, place_weights, scaled_diff
    from kiln.host.model import host_group
    from kiln.host.ranks.verify_ranks import join_ranks

    torch.set_num_threads(max(1, (os.cpu_count() or 2) // tp))
    device = job["device"]
    link.doing("joining the gloo group")
    join_ranks(rank, tp, rendezvous)
    side = host_group()
    cfg = ModelConfig(**job["config"])
    link.doing("loading weights")
    cpu_weights = load_rank_weights(job["checkpoint"], cfg, tp, rank)
    weights = place_weights(cpu_weights, device)
    compiled = load_forward(job["path"], weights, job["sha256"], device=device)
    args = prefill_args(cfg, tp, job["tokens"], page_tokens=job["page_tokens"],
                        pages_per_seq=job["pages_per_seq"], device=device)
    link.doing("running the tp 2 forward")
    with torch.no_grad():
        logits = compiled(*args)[0].float().cpu()
    parts = [torch.empty_like(logits) for _ in range(tp)]
    dist.all_gather(parts, logits, group=side)
    figures = {}
    if rank == 0:
        torch.save({"weights": cpu_weights, "args": [a.cpu() for a in args]}, job["rank0_file"])
        link.doing("running the unsharded eager model")
        full = load_rank_weights(job["checkpoint"], cfg, 1, 0)
        whole = prefill_args(cfg, 1, job["tokens"], page_tokens=job["page_tokens"],
                             pages_per_seq=job["pages_per_seq"], device=device)  # every KV head in the cache
        eager = eager_outputs(cfg, 1, full, whole, device=device)[0][0].float().cpu()
        figures = {"ranks_max_abs_diff": max(float((p - parts[0]).abs().max()) for p in parts[1:]),
                   "vs_unsharded_max_abs_diff": float((parts[0] - eager).abs().max()),
                   "vs_unsharded_scaled_diff": scaled_diff(parts[0], eager)}
    link.doing("leaving the gloo group")
    dist.barrier(group=side)
    dist.destroy_process_group()
    return figures


def gloo_ranks(*, checkpoint: str, config: dict, path: str, sha256: str, tokens: list[int], page_tokens: int,
               pages_per_seq: int, device: str, rank0_file: str, timeout_s: float = 300) -> dict:
    """Rank 0's figures from two gloo ranks of the tp 2 package at `path` on `device` (see the module);
    rank 0 leaves its weights and inputs in `rank0_file` for torch_only_rank0."""
    from kiln.host.ranks.verify_ranks import spawn_ranks

    job = {"checkpoint": checkpoint, "config": config, "path": path, "sha256": sha256, "tokens": tokens,
           "page_tokens": page_tokens, "pages_per_seq": pages_per_seq, "device": device, "rank0_file": rank0_file}
    return spawn_ranks(_rank, 2, job, timeout_s=timeout_s)[0]


TORCH_ONLY = r"""
import json, sys, time
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("kiln", "prefect", "boto3", "dask", "cryptography"):
            raise ImportError(f"{name} is not available here")
sys.meta_path.insert(0, Block())
import torch, torch.distributed as dist
package, data, backend, out, port = sys.argv[1:6]
device = torch.device("cpu") if sys.argv[6] == "cpu" else torch.device("cuda", 0)
if device.type == "cuda":
    torch.cuda.set_device(device)
dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
saved = torch.load(data)
compiled = torch._inductor.aoti_load_package(package)
names = set(compiled.get_constant_fqns())
weights = {n: t.to(device).contiguous() for n, t in saved["weights"].items() if n in names}
try:
    compiled.load_constants(weights, check_full_update=True, user_managed=True)
except TypeError:
    compiled.load_constants(weights, check_full_update=True)
args = [a.to(device) for a in saved["args"]]
with torch.no_grad():
    logits = compiled(*args)[0]
if device.type == "cuda":
    torch.cuda.synchronize()
dist.destroy_process_group()
torch.save(logits.float().cpu(), out)
print(json.dumps({"modules": sorted({m.split(".")[0] for m in sys.modules})}))
"""


def torch_only_rank0(package: str, rank0_file: str, backend: str, device: str, out: Path,
                     timeout_s: float = 120) -> dict:
    """Run rank 0 of the tp 2 package under a one-rank `backend` group in a fresh torch-only interpreter;
    {'logits_file', 'top_modules'}. RuntimeError with its output when it fails."""
    from kiln.host.ranks.verify_ranks import _free_port

    script = out.parent / "torch_only_rank0.py"
    script.write_text(TORCH_ONLY)
    proc = subprocess.run([sys.executable, "-I", str(script), package, rank0_file, backend, str(out),
                           str(_free_port()), device], capture_output=True, text=True, timeout=timeout_s)
    if proc.returncode != 0:
        raise RuntimeError(f"the torch-only rank 0 under {backend} exited {proc.returncode}:\n"
                           f"{proc.stdout[-2000:]}{proc.stderr[-4000:]}")
    return {"logits_file": str(out), "top_modules": json.loads(proc.stdout.strip().splitlines()[-1])["modules"]}
