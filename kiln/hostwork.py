"""Work that runs on one host: probe, compile its share, fetch and check what it lacks.

Side effects live here (store I/O, the compile pool, loading native code); the
decisions are made by the pure core and passed in. Each function is called by
a thin Prefect task on the host it concerns.
"""

from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Callable

from kiln import cache, probe
from kiln.compiler import COMPILER_OPTIONS, CompilePool, CompileResult, model_code_fingerprint
from kiln.errors import DiskError
from kiln.job import ExportJob, HostSpec
from kiln.keys import artifact_key
from kiln.store import open_store


def store_of(job: ExportJob):
    if job.store_block:
        from blocks.kiln_blocks import load_store_block
        return load_store_block(job.store_block).open()
    return open_store(job.store_url, s3_endpoint=job.s3_endpoint, checksum_mode=job.checksum_mode)


def cache_dir(host: HostSpec) -> Path:
    """The host's local cache, resolved where this runs (on the host itself)."""
    return cache.cache_root(host.name, host.cache_dir)


def local_path(host: HostSpec, key: str) -> Path:
    return cache_dir(host) / "forwards" / f"{key}.pt2"


def probe_host(job: ExportJob, host: HostSpec) -> dict:
    """Memory, CPUs, target, this host's forward specs and which of them are local or stored."""
    import torch

    snap = probe.memory_snapshot()
    target = probe.target_fingerprint()
    specs = job.specs(target=target, torch_version=torch.__version__, code=model_code_fingerprint(),
                      compiler=COMPILER_OPTIONS)
    store = store_of(job)
    stored = set(k.rsplit("/", 1)[-1].removesuffix(".pt2") for k in store.list("forwards/"))
    return {
        "name": host.name, "ranks": list(host.ranks), "memory": snap, "num_cpus": probe.num_cpus(),
        "unified": probe.unified_memory() if job.recipe.unified_memory is None else job.recipe.unified_memory,
        "target": target, "specs": [s.to_dict() for s in specs],
        "local_keys": sorted(s.key for s in specs if local_path(host, s.key).exists()),
        "store_keys": sorted(s.key for s in specs if s.key in stored),
        "cache": cache.cache_status(cache_dir(host)),
    }


def compile_on_host(job: ExportJob, host: HostSpec, specs: list[dict], workers: int,
                    on_done: Callable[[CompileResult], None] | None = None) -> list[dict]:
    """Compile `specs` in a pool of `workers` spawned processes; upload each the moment it is done."""
    store = store_of(job)
    uploaded: list[dict] = []

    def upload(result: CompileResult) -> None:
        created = store.put_file(artifact_key(result.key), result.path, result.sha256)
        uploaded.append({"key": result.key, "sha256": result.sha256, "size_bytes": result.size_bytes,
                         "compile_s": round(result.compile_s, 3), "compiled_by": host.name,
                         "created": created, "attempts": result.attempts})
        if on_done:
            on_done(result)

    jobs = [(spec, str(local_path(host, spec["key"]))) for spec in specs]
    with CompilePool(workers, max_attempts=job.recipe.max_compile_attempts) as pool:
        pool.run(jobs, upload)
    return uploaded


def fetch_missing(job: ExportJob, host: HostSpec, forwards: list[dict]) -> int:
    """Copy every forward this host lacks (or holds with the wrong digest) from the store; verified."""
    from kiln.loader import sha256_of

    store = store_of(job)
    fetched = 0
    for f in forwards:
        path = local_path(host, f["key"])
        if path.exists() and sha256_of(path) == f["sha256"]:
            continue
        try:
            store.get_file(artifact_key(f["key"]), path, f["sha256"])
        except OSError as exc:
            if exc.errno not in cache.DISK_ERRNOS:
                raise
            raise DiskError(f"host {host.name} cannot write forward {f['key']} into its cache: "
                            f"{exc.strerror} ({exc.filename or path}); free space there or point "
                            "KILN_CACHE_DIR at a writable local disk with room.") from None
        fetched += 1
    return fetched


def _check_rank(job: ExportJob, host: HostSpec, rank: int, forwards: list[dict]) -> dict:
    from kiln.checkpoint import load_rank_weights
    from kiln.loader import compare_with_eager, load_forward
    from kiln.recipe import parse_buckets

    cfg = job.model_config
    diffs: dict[str, float] = {}
    weights = load_rank_weights(job.checkpoint, cfg, job.tp, rank)
    for f in forwards:
        compiled = load_forward(local_path(host, f["key"]), weights, f["sha256"])
        diff = compare_with_eager(compiled, cfg, job.tp, rank, weights, parse_buckets(f["bucket"])[0],
                                  page_tokens=job.recipe.page_tokens, pages_per_seq=job.recipe.pages_per_seq)
        diffs[f"rank{rank}/{f['bucket']}"] = diff
    return diffs


def check_ranks(job: ExportJob, host: HostSpec, forwards: list[dict]) -> dict:
    """Load each forward with each of this host's rank weights and compare with eager.

    Each rank runs in its own spawned process, as it would when serving:
    loading native code must not be able to take the orchestrating process
    down, and AOTInductor crashes when one process loads a package twice.
    """
    diffs: dict[str, float] = {}
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"), max_tasks_per_child=1) as ex:
        for rank in host.ranks:
            diffs.update(ex.submit(_check_rank, job, host, rank, forwards).result())
    return diffs
