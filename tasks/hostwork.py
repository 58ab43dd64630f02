"""Work that runs on one host: probe, compile its share, fetch and check what it lacks.

Side effects live here (store I/O, the compile pool, loading native code); the
decisions are made by the pure core and passed in. Each function is called by
a thin Prefect task on the host it concerns.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from kiln.core import layout, tuning_plan
from kiln.core.errors import DiskError, IntegrityError, MemoryShort
from kiln.core.job import ExportJob, HostSpec
from kiln.core.layout import artifact_key, compile_log_key, inspection_key, worker_memory_key, worker_memory_prefix
from kiln.core.probe_result import HostProbe
from kiln.core.sizing import check_peak_mib
from kiln.host import cache, faults, probe, tuner
from kiln.host.compiler import CompilePool, CompileResult, model_code_fingerprint
from kiln.host.inductor_options import FORWARD_DEVICE, compiler_options
from kiln.host.leasing import Leases, compile_leased
from kiln.host.procs import PeakSampler, die_with_parent
from kiln.store import ObjectMissing, open_store

log = logging.getLogger(__name__)


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


def probe_host(job: ExportJob, host: HostSpec) -> HostProbe:
    """Memory, CPUs, target, this host's forward specs and which of them are local or stored.

    With tuning on, each spec carries the stored tuning results of its GEMMs
    (verified) and its key their digest.
    """
    import torch

    snap = probe.memory_snapshot()
    target = probe.target_fingerprint()
    store = store_of(job)
    backends = tuning_plan.gemm_backends(job.recipe.tuning, FORWARD_DEVICE)
    tuned = None if backends is None else tuner.lookup(store, job, target, torch.__version__, backends)
    specs = job.specs(target=target, torch_version=torch.__version__, code=model_code_fingerprint(),
                      compiler=compiler_options(backends), tuning=tuned)
    stored = layout.forward_keys_in(store.list(layout.FORWARDS))
    return HostProbe(
        name=host.name, ranks=tuple(host.ranks), memory=snap, num_cpus=probe.num_cpus(),
        unified=probe.unified_memory() if job.recipe.unified_memory is None else job.recipe.unified_memory,
        target=target, specs=tuple(s.to_dict() for s in specs),
        local_keys=tuple(sorted(s.key for s in specs if local_path(host, s.key).exists())),
        store_keys=tuple(sorted(s.key for s in specs if s.key in stored)),
        cache=cache.cache_status(cache_dir(host)),
        worker_peaks_mib=tuple(measured_peaks(store, specs)))


def compile_records(job: ExportJob, keys: list[str]) -> dict[str, dict]:
    """key -> the compile record this export wrote for it; a key another export compiled has none."""
    store, out = store_of(job), {}
    for key in keys:
        try:
            out[key] = store.get_json(compile_log_key(job.export_id, key))
        except ObjectMissing:
            pass
    return out


def break_leases(job: ExportJob, keys: list[str], hosts: set[str]) -> int:
    """Drop the leases that `hosts` (lost mid-compile) of this export hold on `keys`; returns how many."""
    store = store_of(job)
    owners = {f"{job.export_id}:{h}" for h in hosts}
    broken = 0
    for key in keys:
        for obj in store.list(layout.lease_prefix(key)):
            try:
                doc = store.get_json(obj)
            except (IntegrityError, ObjectMissing):
                continue
            if doc.get("owner") in owners:
                store.delete(obj)
                broken += 1
    return broken


def compile_on_host(job: ExportJob, host: HostSpec, specs: list[dict], workers: int) -> dict:
    """Compile `specs` in a pool of `workers` spawned processes; upload each the moment it is done.

    Returns {'forwards': one entry per key this host compiled, 'memory': the host's
    lowest available MiB and this process tree's peak MiB (the pool included) while compiling,
    'waited_for_lease': the keys it found leased by another export and waited for}.

    Each key is compiled under a lease, taken when its compile is submitted
    to a worker and renewed while it compiles: a key another export is
    compiling right now is waited for (and reused) instead of compiled twice;
    a lease whose holder is provably gone (expired, or its process on this
    host dead) is taken over. Each compiled forward's worker peak is kept in the
    store per (graph, target), for the gate of later exports. The specs'
    tuning results are fetched and verified first and installed in every
    worker before it compiles; each entry's 'autotune' says how many
    GEMMs were autotuned and how many candidates were benchmarked (0 when the
    stored results covered them).
    """
    import torch

    store = store_of(job)
    entries = tuner.load_for_compile(store, specs, torch.__version__)
    leases = Leases(store, f"{job.export_id}:{host.name}", job.recipe.lease_ttl_s)
    uploaded: list[dict] = []

    def upload(result: CompileResult) -> None:
        created = store.put_file(artifact_key(result.key), result.path, result.sha256)
        entry = {"key": result.key, "sha256": result.sha256, "size_bytes": result.size_bytes,
                 "compile_s": round(result.compile_s, 3), "compiled_by": host.name, "created": created,
                 "autotune": result.autotune, "attempts": result.attempts, "compile_peak_mib": result.peak_mib}
        store.put_json(compile_log_key(job.export_id, result.key), entry, overwrite=True)
        store.put_json(inspection_key(result.key), {"sha256": result.sha256, **result.calls}, overwrite=True)
        spec = by_key[result.key]
        store.put_json(worker_memory_key(spec, result.key), {"compile_peak_mib": result.peak_mib,
                                                             "bucket": spec["bucket"]}, overwrite=True)
        leases.release(result.key)
        uploaded.append(entry)
        if entries and result.autotune and result.autotune["benchmarked"]:
            log.warning("forward %s benchmarked %d GEMM candidate(s) while compiling although tuning results "
                        "were installed: some GEMM shape was not tuned", result.key, result.autotune["benchmarked"])
        faults.point("uploaded", len(uploaded))

    def job_of(spec: dict) -> tuple[dict, str]:
        return spec, str(local_path(host, spec["key"]))

    by_key = {s["key"]: s for s in specs}
    with PeakSampler(interval_s=0.2) as sampler, \
            CompilePool(workers, max_attempts=job.recipe.max_compile_attempts, tuning_entries=entries) as pool:
        waited = compile_leased(pool, leases, store, [job_of(s) for s in specs], upload)
    return {"forwards": uploaded, "memory": {"min_available_mib": sampler.min_available_mib,
                                             "peak_tree_mib": sampler.peak_mib},
            "waited_for_lease": sorted(waited)}


def measured_peaks(store, specs: list) -> list[int]:
    """Worker peaks (MiB) measured before for the graph and target of `specs` (one graph per host)."""
    if not specs:
        return []
    peaks = []
    for obj in store.list(worker_memory_prefix(specs[0].to_dict())):
        try:
            peaks.append(int(store.get_json(obj)["compile_peak_mib"]))
        except (IntegrityError, ObjectMissing, KeyError, TypeError, ValueError):
            continue  # an unreadable record is not a measurement
    return peaks


def stored_forwards(store, keys: list[str]) -> tuple[dict[str, dict], list[str]]:
    """(key -> {'sha256', 'size_bytes', 'calls'} of each stored forward, the keys not in the store).

    'calls' is the inspection record of the stored bytes (kiln.core.package_check.package_calls), written
    by the host that compiled it; a package without one that matches its sha256 (its compiler died
    between the two uploads, or an older Kiln made it) is downloaded, checked and inspected here.
    """
    import tempfile

    from kiln.core.package_check import check_package, package_calls

    found, missing = {}, []
    for key in keys:
        info = store.stat(artifact_key(key))
        if info is None or not info.sha256:
            missing.append(key)
            continue
        try:
            record = store.get_json(inspection_key(key))
        except (ObjectMissing, IntegrityError):
            record = None
        if not isinstance(record, dict) or record.get("sha256") != info.sha256:
            with tempfile.TemporaryDirectory(prefix="kiln-inspect-") as tmp:
                path = Path(tmp) / f"{key}.pt2"
                store.get_file(artifact_key(key), path, info.sha256)
                check_package(path)
                record = {"sha256": info.sha256, **package_calls(path).to_dict()}
            store.put_json(inspection_key(key), record, overwrite=True)
        found[key] = {"sha256": info.sha256, "size_bytes": info.size_bytes,
                      "calls": {k: record[k] for k in ("python_free", "ops", "why")}}
    return found, missing


def fetch_missing(job: ExportJob, host: HostSpec, forwards: list[dict]) -> int:
    """Copy every forward this host lacks (or holds with the wrong digest) from the store; verified."""
    from kiln.host.loader import sha256_of

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
    from kiln.core.recipe import parse_buckets
    from kiln.host.loader import compare_with_eager, load_forward
    from kiln.host.weights import load_rank_weights
    from kiln.host.model import solo_group

    cfg = job.model_config
    diffs: dict[str, dict] = {}
    # One rank alone: its collectives sum over itself, in the compiled forward and in eager alike.
    with PeakSampler(interval_s=0.1) as sampler, solo_group():
        weights = load_rank_weights(job.checkpoint, cfg, job.tp, rank, s3_endpoint=job.s3_endpoint,
                                    cache_dir=cache_dir(host))
        for f in forwards:
            compiled = load_forward(local_path(host, f["key"]), weights, f["sha256"])
            diffs[f"rank{rank}/{f['bucket']}"] = compare_with_eager(
                compiled, cfg, job.tp, rank, weights, parse_buckets(f["bucket"])[0],
                page_tokens=job.recipe.page_tokens, pages_per_seq=job.recipe.pages_per_seq,
                atol=job.recipe.verify_atol, half_ratio=job.recipe.verify_half_ratio)
    return {"checks": diffs, "peak_mib": sampler.peak_mib}


def check_memory(job: ExportJob, num_forwards: int, available_mib: int, what: str) -> int:
    """Predicted peak MiB of one rank's check; MemoryShort (before anything starts) when it cannot fit."""
    cfg = job.model_config
    need = check_peak_mib(shard_bytes=cfg.weight_bytes_per_rank(job.tp), num_forwards=num_forwards,
                          half=cfg.dtype != "float32", process_base_mib=job.recipe.process_base_mib)
    if need > available_mib:
        raise MemoryShort(f"{what}: checking one rank against eager needs about {need} MiB ({num_forwards} "
                          f"forward(s) of a {cfg.weight_bytes_per_rank(job.tp) // 2**20} MiB shard in {cfg.dtype}) "
                          f"but {available_mib} MiB are available; free memory there, or export fewer buckets "
                          "per run.")
    return need


def _mtime_iso(path) -> str:
    """UTC time (seconds) of `path`'s last change, or now for None."""
    import datetime as dt

    when = dt.datetime.fromtimestamp(path.stat().st_mtime, dt.timezone.utc) if path else dt.datetime.now(dt.timezone.utc)
    return when.isoformat(timespec="seconds")


def check_ranks(job: ExportJob, host: HostSpec, forwards: list[dict]) -> dict[str, dict]:
    """Load each forward with each of this host's rank weights and compare with eager.

    Returns {'checks': 'rank<r>/<bucket>' -> {'diff', 'limit', ...} (kiln.host.loader.check_against_eager), 'memory':
    {'predicted_mib', 'peak_mib'} of the largest rank check}. A check that would not fit in the
    host's available memory is refused (MemoryShort) before its process starts.

    Each rank runs in its own spawned process, as it would when serving:
    loading native code must not be able to take the orchestrating process
    down, and AOTInductor crashes when one process loads a package twice.
    A check passed before on this host for the same artifact bytes, rank and
    checkpoint content is remembered in the host's cache and not run again.
    """
    from kiln.host.loader import limit_of
    from kiln.host.weights import fingerprint

    weights = fingerprint(job.checkpoint, s3_endpoint=job.s3_endpoint, digests=cache_dir(host) / "digests")
    record = cache_dir(host) / "verified"
    diffs: dict[str, dict] = {}
    todo: dict[int, list[dict]] = {}
    for rank in host.ranks:
        for f in forwards:
            # v3: 'own' is eager's error against float32 routed as eager was (kiln.host.routing_ties).
            seen = record / f"{f['sha256']}-tp{job.tp}-rank{rank}-{weights}.v3.json"
            check = cache.read_record(seen)
            # The measured figures are remembered (an unreadable record counts as none); the limit is this export's.
            if check is not None and isinstance(check.get("diff"), (int, float)):
                check["remembered"] = check.pop("verified_at", None) or _mtime_iso(seen)
                check["limit"] = limit_of(check.get("own"), atol=job.recipe.verify_atol,
                                          half_ratio=job.recipe.verify_half_ratio)
                diffs[f"rank{rank}/{f['bucket']}"] = check
            else:
                todo.setdefault(rank, []).append(f)
    memory = {"predicted_mib": None, "peak_mib": None}
    if not todo:
        return {"checks": diffs, "memory": memory}
    memory["predicted_mib"] = check_memory(job, max(len(fs) for fs in todo.values()),
                                           probe.memory_snapshot()["host_available_mib"], f"host {host.name}")
    memory["peak_mib"] = 0
    with ProcessPoolExecutor(1, mp_context=mp.get_context("spawn"), max_tasks_per_child=1,
                             initializer=die_with_parent) as ex:
        for rank, fs in todo.items():
            result = ex.submit(_check_rank, job, host, rank, fs).result()
            found = result["checks"]
            memory["peak_mib"] = max(memory["peak_mib"], result["peak_mib"])
            diffs.update(found)
            for f in fs:
                check = found[f"rank{rank}/{f['bucket']}"]
                if check["diff"] <= check["limit"]:
                    cache.write_record(record / f"{f['sha256']}-tp{job.tp}-rank{rank}-{weights}.v3.json",
                                       {**check, "verified_at": _mtime_iso(None)})
    return {"checks": diffs, "memory": memory}
