"""Work that runs on one host: probe, compile its share, fetch and check what it lacks.

Side effects live here (store I/O, the compile pool, loading native code); the
decisions are made by the pure core and passed in. Each function is called by
a thin Prefect task on the host it concerns.
"""

from __future__ import annotations

import logging
from pathlib import Path

from kiln.core import layout, tuning_plan
from kiln.core.errors import CheckCrashed, DiskError, IntegrityError, MemoryShort, StoreConflict, StoreError
from kiln.core.job import ExportJob, HostSpec
from kiln.core.layout import (artifact_key, compile_log_key, inspection_key, vouch_key, worker_memory_key,
                              worker_memory_prefix)
from kiln.core.probe_result import HostProbe
from kiln.core.sizing import check_peak_mib
from kiln.core.target import host_device
from kiln.core.vouch import make_vouch
from kiln.host import cache, faults, probe, tuner
from kiln.host.compiler import CompilePool, CompileResult
from kiln.host.key_sources import model_code_fingerprint
from kiln.host.inductor_options import compiler_options, inductor_env
from kiln.host.leasing import Leases, compile_leased
from kiln.host.procs import ChildDied, PeakSampler, call_in_spawned
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
    """Memory, CPUs, GPUs, target, this host's forward specs and which of them are local or stored.

    The target is for the recipe's device as this host alone sees it (auto: cuda where it has a GPU; cuda
    on a host without one probes as cpu, and kiln.core.decisions.check_devices refuses the export naming
    every such host). With tuning on, each spec carries the stored tuning results of its GEMMs (verified)
    and its key their digest.
    """
    import torch

    from kiln.host.trust import export_signer
    from kiln.core.home import kiln_home

    export_signer(job.signing, kiln_home(), host.name)  # every host may compile, so every host needs the key
    reading = probe.gpu_reading()
    snap = probe.memory_snapshot(reading)
    cpus, cpus_source = probe.cpus_and_source()
    num_gpus = probe.usable_gpus(reading)
    device = host_device(job.recipe.device, num_gpus) if num_gpus else "cpu"
    target_of_host = probe.detect_target(device, reading)
    target = target_of_host.fingerprint
    store = store_of(job)
    backends = tuning_plan.gemm_backends(job.recipe.tuning, device)
    tuned = None if backends is None else tuner.lookup(store, job, target, torch.__version__, backends)
    specs = job.specs(target=target, torch_version=torch.__version__, code=model_code_fingerprint(),
                      compiler={**compiler_options(backends), **target_of_host.inductor_options}, tuning=tuned,
                      inductor_env=inductor_env(), device=device)
    return HostProbe(
        name=host.name, ranks=tuple(host.ranks), memory=snap, num_cpus=cpus, cpus_source=cpus_source,
        unified=reading.unified if job.recipe.unified_memory is None else job.recipe.unified_memory,
        target=target, device=device, num_gpus=num_gpus, specs=tuple(s.to_dict() for s in specs),
        local_keys=tuple(sorted(s.key for s in specs if local_path(host, s.key).exists())),
        store_keys=tuple(sorted(s.key for s in specs if store.exists(artifact_key(s.key)))),  # no listing
        cache=cache.cache_status(cache_dir(host)),
        **measured_compiles(store, specs))


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
        for obj in layout.lease_generations(key, store.list(layout.lease_prefix(key))).values():
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

    Returns {'forwards': one entry per key this host compiled and stored, 'reused': {'key', 'sha256',
    'discarded'} of each key it compiled but found stored by another compile when it uploaded, 'memory':
    the host's lowest available MiB and this process tree's peak MiB (the pool included) while
    compiling, 'waited_for_lease': the keys it found leased by another export and waited for}.

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

    from kiln.host.trust import export_signer
    from kiln.core.home import kiln_home

    signer = export_signer(job.signing, kiln_home(), host.name)  # before any compile: a host without the key stops
    store = store_of(job)
    entries = tuner.load_for_compile(store, specs, torch.__version__)
    leases = Leases(store, f"{job.export_id}:{host.name}", job.recipe.lease_ttl_s)
    uploaded: list[dict] = []
    reused: list[dict] = []

    def upload(result: CompileResult) -> None:
        spec = by_key[result.key]
        store.put_json(worker_memory_key(spec, result.key), {"compile_peak_mib": result.peak_mib,
                                                             "compile_s": round(result.compile_s, 3),
                                                             "shapes": spec["shapes"]}, overwrite=True)
        stored = publish(store, job, host.name, result, signer)
        leases.release(result.key)
        if stored != result.sha256:  # another compile of the key was stored first: reuse it (if vouched)
            log.warning("forward %s was stored by another compile (sha256 %s) while this host compiled it; "
                        "that one is used", result.key, stored)
            reused.append({"key": result.key, "sha256": stored, "discarded": result.sha256})
            return
        entry = {"key": result.key, "sha256": result.sha256, "size_bytes": result.size_bytes,
                 "compile_s": round(result.compile_s, 3), "compiled_by": host.name, "created": True,
                 "autotune": result.autotune, "attempts": result.attempts, "compile_peak_mib": result.peak_mib}
        store.put_json(compile_log_key(job.export_id, result.key), entry, overwrite=True)
        store.put_json(inspection_key(result.key), {"sha256": result.sha256, **result.calls}, overwrite=True)
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
        waited = compile_leased(pool, leases, store, [job_of(s) for s in specs], upload,
                                wait_s=job.recipe.lease_wait_s)
    return {"forwards": uploaded, "reused": reused,
            "memory": {"min_available_mib": sampler.min_available_mib, "peak_tree_mib": sampler.peak_mib},
            "waited_for_lease": sorted(waited)}


def publish(store, job: ExportJob, host_name: str, result: CompileResult, signer) -> str:
    """Vouch for a compiled forward (signed export), then upload it create-once; the sha256 stored under
    its key. That is `result.sha256`, or the digest of another compile of the key stored first (.pt2
    bytes differ between compiles): a second compile is reuse, never an error; whether the other bytes
    may be loaded is the reader's check of their vouch (kiln.core.vouch).

    The vouch goes first, so a package this export stored is never without one, even if the host
    dies right after the upload.
    """
    if signer is not None:
        doc = make_vouch(result.key, result.sha256, export_id=job.export_id, compiled_by=host_name, signer=signer)
        try:
            store.put_json(vouch_key(result.key, result.sha256), doc)
        except StoreConflict:  # identical bytes vouched for before (by this key or another): ours is as good
            store.put_json(vouch_key(result.key, result.sha256), doc, overwrite=True)
    try:
        store.put_file(artifact_key(result.key), result.path, result.sha256)
    except StoreConflict as exc:
        if not exc.existing:
            raise
        return exc.existing
    return result.sha256


def measured_compiles(store, specs: list) -> dict:
    """What compiles of the graph and target of `specs` (one graph per host) measured before: HostProbe's
    {'worker_peaks_mib': peaks (MiB), 'compile_seconds': (shapes, seconds) of those that recorded them}."""
    peaks, seconds = [], []
    for obj in store.list(worker_memory_prefix(specs[0].to_dict())) if specs else ():
        try:
            record = store.get_json(obj)
            peaks.append(int(record["compile_peak_mib"]))
        except (IntegrityError, ObjectMissing, KeyError, TypeError, ValueError):
            continue  # an unreadable record is not a measurement
        if isinstance(record.get("compile_s"), (int, float)) and isinstance(record.get("shapes"), str):
            seconds.append((record["shapes"], float(record["compile_s"])))
    return {"worker_peaks_mib": tuple(peaks), "compile_seconds": tuple(seconds)}


def trusted_digests(store, keys: list[str], trusted: dict, own: dict[str, str]) -> dict[str, str]:
    """key -> the sha256 of its stored forward that may be loaded; IntegrityError (kiln.core.vouch) naming
    the stored forwards nobody trusted vouched for. Keys not in the store are left out.

    A stored digest is trusted when the vouch for it verifies with one of `trusted` (fingerprint ->
    public key), or when it is this export's own compile (`own`: key -> the digest its compiling host's
    task returned, not the store's word).
    """
    from kiln.core.vouch import check_vouch, unvouched_error

    out, recorded, unvouched = {}, {}, []
    for key in keys:
        info = store.stat(artifact_key(key))
        if info is None:
            continue
        recorded[key] = info.sha256
        if info.sha256 and own.get(key) == info.sha256:
            out[key] = info.sha256
            continue
        try:
            doc = store.get_json(vouch_key(key, info.sha256)) if info.sha256 else None
        except (ObjectMissing, IntegrityError, ValueError):
            doc = None
        except StoreError as exc:  # unreadable for good (e.g. a file written behind the store's back): no vouch
            if exc.transient:
                raise
            doc = None
        if info.sha256 and check_vouch(doc, key, info.sha256, trusted):
            out[key] = info.sha256
        else:
            unvouched.append(key)
    if unvouched:
        raise unvouched_error(unvouched, recorded, trusted, {k: artifact_key(k) for k in unvouched})
    return out


def stored_forwards(store, keys: list[str], digests: dict[str, str]) -> tuple[dict[str, dict], list[str]]:
    """(key -> {'sha256', 'size_bytes', 'calls'} of each stored forward, the keys not in the store).

    `digests`: key -> the trusted sha256 of its forward (`trusted_digests`); a key the store holds
    with other bytes than those raises IntegrityError, and a stored key without a trusted digest
    counts as missing. 'calls' is the inspection record of those bytes
    (kiln.host.package_check.package_calls), written by the host that compiled them; a package
    without one (its compiler died between the two uploads, or an older Kiln made it) is downloaded,
    checked against the trusted digest and inspected here.
    """
    import tempfile

    from kiln.host.package_check import check_package, package_calls

    found, missing = {}, []
    for key in keys:
        info = store.stat(artifact_key(key))
        if info is None or key not in digests:
            missing.append(key)
            continue
        sha256 = digests[key]
        if info.sha256 != sha256:
            raise IntegrityError(f"forward {key}: the store now records sha256 {info.sha256} for "
                                 f"{artifact_key(key)}, not the trusted {sha256}; it was changed behind this "
                                 "export. Delete the object and export again.")
        try:
            record = store.get_json(inspection_key(key))
        except (ObjectMissing, IntegrityError):
            record = None
        if not isinstance(record, dict) or record.get("sha256") != sha256:
            with tempfile.TemporaryDirectory(prefix="kiln-inspect-") as tmp:
                path = Path(tmp) / f"{key}.pt2"
                store.get_file(artifact_key(key), path, sha256)
                check_package(path)
                record = {"sha256": sha256, **package_calls(path).to_dict()}
            store.put_json(inspection_key(key), record, overwrite=True)
        found[key] = {"sha256": sha256, "size_bytes": info.size_bytes,
                      "calls": {k: record[k] for k in ("python_free", "ops", "why")}}
    return found, missing


def fetch_missing(job: ExportJob, host: HostSpec, forwards: list[dict]) -> int:
    """Copy every forward this host lacks (or holds with the wrong digest) from the store; verified."""
    from kiln.store import sha256_file

    store = store_of(job)
    fetched = 0
    for f in forwards:
        path = local_path(host, f["key"])
        if path.exists() and sha256_file(path) == f["sha256"]:
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
    from kiln.core.shape_ranges import parse_shape_range
    from kiln.core.target import device_of
    from kiln.host.loader import compare_at_corners, load_forward, place_weights
    from kiln.host.verify_ranks import rank_device
    from kiln.host.weights import load_rank_weights
    from kiln.host.model import solo_group

    faults.point("check", rank)
    cfg = job.model_config
    diffs: dict[str, dict] = {}
    # One rank alone: its collectives sum over itself, in the compiled forward and in eager alike.
    # The export's forwards share one device (kiln.core.manifest); rank r takes GPU r mod GPUs on a GPU host.
    device = rank_device(device_of(forwards[0]["target"]), rank) if forwards else "cpu"
    with PeakSampler(interval_s=0.1) as sampler, solo_group():
        # One copy of the rank's weights on its device, bound by every forward's package (kiln.host.loader).
        weights = place_weights(load_rank_weights(job.checkpoint, cfg, job.tp, rank, s3_endpoint=job.s3_endpoint,
                                                  cache_dir=cache_dir(host)), device)
        for f in forwards:
            compiled = load_forward(local_path(host, f["key"]), weights, f["sha256"], device=device)
            diffs[f"rank{rank}/{f['shapes']}"] = compare_at_corners(
                compiled, cfg, job.tp, rank, weights, parse_shape_range(f["shapes"]),
                page_tokens=job.recipe.page_tokens, pages_per_seq=job.recipe.pages_per_seq,
                atol=job.recipe.verify_atol, half_ratio=job.recipe.verify_half_ratio, device=device)
    return {"checks": diffs, "peak_mib": sampler.peak_mib}


def check_memory(job: ExportJob, num_forwards: int, available_mib: int, what: str) -> int:
    """Predicted peak MiB of one rank's check; MemoryShort (before anything starts) when it cannot fit."""
    cfg = job.model_config
    need = check_peak_mib(shard_bytes=cfg.weight_bytes_per_rank(job.tp), num_forwards=num_forwards,
                          half=cfg.dtype != "float32", process_base_mib=job.recipe.process_base_mib)
    if need > available_mib:
        raise MemoryShort(f"{what}: checking one rank against eager needs about {need} MiB ({num_forwards} "
                          f"forward(s) of a {cfg.weight_bytes_per_rank(job.tp) // 2**20} MiB shard in {cfg.dtype}) "
                          f"but {available_mib} MiB are available; free memory there, or use a larger tp (a "
                          "smaller shard).")
    return need


def _mtime_iso(path) -> str:
    """UTC time (seconds) of `path`'s last change, or now for None."""
    import datetime as dt

    when = dt.datetime.fromtimestamp(path.stat().st_mtime, dt.timezone.utc) if path else dt.datetime.now(dt.timezone.utc)
    return when.isoformat(timespec="seconds")


def remember_check(path: Path, check: dict) -> None:
    """Keep a passed check in the host's cache; a write that fails only costs running it again next time."""
    try:
        cache.write_record(path, check)
    except OSError as exc:
        log.warning("could not remember a passed check in %s (%s): the next export will run it again",
                    path, exc.strerror or exc)


def check_ranks(job: ExportJob, host: HostSpec, forwards: list[dict]) -> dict[str, dict]:
    """Load each forward with each of this host's rank weights and compare with eager.

    Returns {'checks': 'rank<r>/<shapes>' -> {'diff', 'limit', 'at', ...} (the worst of the forward's range's
    corners, kiln.host.loader.compare_at_corners), 'memory':
    {'predicted_mib', 'peak_mib'} of the largest rank check}. A check that would not fit in the
    host's available memory is refused (MemoryShort) before its process starts.

    Each rank runs in its own spawned process, as it would when serving:
    loading native code must not be able to take the orchestrating process
    down, and AOTInductor crashes when one process loads a package twice.
    A check passed before on this host for the same artifact bytes, rank and
    checkpoint content is remembered in the host's cache and not run again.
    A check whose process dies raises CheckCrashed, which is never retried.
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
                diffs[f"rank{rank}/{f['shapes']}"] = check
            else:
                todo.setdefault(rank, []).append(f)
    memory = {"predicted_mib": None, "peak_mib": None}
    if not todo:
        return {"checks": diffs, "memory": memory}
    memory["predicted_mib"] = check_memory(job, max(len(fs) for fs in todo.values()),
                                           probe.host_memory()["host_available_mib"], f"host {host.name}")
    memory["peak_mib"] = 0
    for rank, fs in todo.items():
        try:
            result = call_in_spawned(_check_rank, job, host, rank, fs)
        except ChildDied:
            raise CheckCrashed(
                f"host {host.name}: the check of rank {rank} died (its process crashed loading or running a "
                f"forward of shapes {', '.join(f['shapes'] for f in fs)}, or was killed); a crash is final, "
                "not retried") from None
        found = result["checks"]
        memory["peak_mib"] = max(memory["peak_mib"], result["peak_mib"])
        diffs.update(found)
        for f in fs:
            check = found[f"rank{rank}/{f['shapes']}"]
            if check["diff"] <= check["limit"]:
                remember_check(record / f"{f['sha256']}-tp{job.tp}-rank{rank}-{weights}.v3.json",
                               {**check, "verified_at": _mtime_iso(None)})
    return {"checks": diffs, "memory": memory}
