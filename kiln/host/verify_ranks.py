"""All ranks together: the compiled forwards under a real gloo group against the unsharded model.

Spawns `tp` processes (never threads), each loading the same weightless
package with its own weight shard; the custom all-reduce inside the package
sums across them. Rank 0 compares the combined logits and the gathered new
KV entries with the unsharded eager model.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import traceback

from kiln.core.errors import IntegrityError, KilnError


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, tp: int, port: int, job: dict, queue) -> None:
    from kiln.host.procs import PeakSampler, die_with_parent

    die_with_parent()
    os.environ["AOTI_RUNTIME_CHECK_INPUTS"] = "1"  # a wrong shape raises instead of crashing or lying
    try:
        with PeakSampler(interval_s=0.1) as sampler:
            diffs = _check_together(rank, tp, port, job)
        queue.put((rank, "ok", {"diffs": diffs, "peak_mib": sampler.peak_mib}))
    except KilnError as exc:  # e.g. a refused artifact: its message says it all
        queue.put((rank, "refused", str(exc)))
    except BaseException:
        queue.put((rank, "error", traceback.format_exc()))


def _check_together(rank: int, tp: int, port: int, job: dict) -> dict:
    import torch
    import torch.distributed as dist

    from kiln.core.config import ModelConfig
    from kiln.core.contract import cache_layout
    from kiln.core.recipe import parse_buckets
    from kiln.host.loader import check_against_eager, load_forward
    from kiln.host.weights import load_rank_weights
    from kiln.host.model import example_inputs, host_group

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=tp)
    side = host_group()
    cfg = ModelConfig(**job["config"])
    weights = load_rank_weights(job["checkpoint"], cfg, tp, rank, s3_endpoint=job.get("s3_endpoint"))
    full = load_rank_weights(job["checkpoint"], cfg, 1, 0, s3_endpoint=job.get("s3_endpoint")) if rank == 0 else None
    layout = cache_layout(cfg, tp)
    diffs = {}
    for name, art in sorted(job["artifacts"].items()):
        bucket = parse_buckets(name)[0]
        compiled = load_forward(art["path"], weights, art["sha256"])
        args = example_inputs(
            cfg, 1, bucket.batch, bucket.tokens, page_tokens=job["page_tokens"],
            pages_per_seq=job["pages_per_seq"], num_pages=job["pages_per_seq"] * bucket.batch + 5, seed=7)
        cache = args[2]
        # Each rank caches its own KV heads, or (latent attention) every rank the same whole latent.
        heads = layout.heads
        shard = cache[..., rank * heads:(rank + 1) * heads, :].contiguous() if layout.sharded else cache
        with torch.no_grad():
            logits, new_kv = compiled(*args[:2], shard, *args[3:])
        parts = [torch.empty_like(new_kv) for _ in range(tp)]
        dist.all_gather(parts, new_kv.contiguous(), group=side)
        if rank == 0:
            every = torch.cat(parts, dim=-2) if layout.sharded else _same(parts)
            diffs[name] = check_against_eager((logits, every), cfg, 1, full, args, atol=job["atol"],
                                              half_ratio=job["half_ratio"])
    dist.barrier(group=side)
    dist.destroy_process_group()
    return diffs


def _same(parts: list):
    """The one cache entry every rank computed alike (latent attention's); IntegrityError when they differ."""
    import torch

    for rank, part in enumerate(parts[1:], start=1):
        if not torch.equal(part, parts[0]):
            raise IntegrityError(f"rank {rank}'s new latent cache entries differ from rank 0's; every rank must "
                                 "compute the same latent (its projection is replicated).")
    return parts[0]


def verify_all_ranks(*, checkpoint: str, config: dict, tp: int, artifacts: dict[str, dict], page_tokens: int,
                     pages_per_seq: int, atol: float, half_ratio: float, s3_endpoint: str | None = None,
                     timeout_s: float = 600) -> tuple[dict[str, dict], int]:
    """(bucket -> {'diff', 'limit'} of the compiled ranks combined against the unsharded eager model
    (kiln.host.loader.check_against_eager), the ranks' peak MiB added up); raises on any rank's error.

    `artifacts` maps a bucket name ('4x32') to {'path', 'sha256'} of a verified local copy.
    """
    job = {"checkpoint": str(checkpoint), "s3_endpoint": s3_endpoint, "config": config, "artifacts": artifacts,
           "atol": atol, "half_ratio": half_ratio, "page_tokens": page_tokens, "pages_per_seq": pages_per_seq}
    results = spawn_ranks(_rank_main, tp, job, timeout_s=timeout_s)
    return results[0]["diffs"], sum(r["peak_mib"] for r in results.values())


def spawn_ranks(target, tp: int, job: dict, *, timeout_s: float = 600) -> dict[int, object]:
    """Run `target(rank, tp, port, job, queue)` in `tp` spawned processes under one gloo group.

    Each rank puts (rank, 'ok' | 'refused' | 'error', payload) on the queue;
    returns rank -> payload, or raises: IntegrityError for a refusal (its
    message says it all), RuntimeError with the rank's traceback otherwise.
    """
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=target, args=(r, tp, port, job, queue), daemon=False) for r in range(tp)]
    for p in procs:
        p.start()
    results = {}
    try:
        for _ in range(tp):
            rank, status, payload = queue.get(timeout=timeout_s)
            if status == "refused":
                raise IntegrityError(f"rank {rank}: {payload}")
            if status != "ok":
                raise RuntimeError(f"rank {rank} failed:\n{payload}")
            results[rank] = payload
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return results
