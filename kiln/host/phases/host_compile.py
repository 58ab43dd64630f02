"""A host's share of the compile phase: compile its forwards under leases in its pool, vouch for and upload
each the moment it is done, record what each compile measured; and the flow's bookkeeping of those
records (compile_records) and of leases held by hosts lost mid-compile (break_leases)."""

from __future__ import annotations

import logging

from kiln.core.trust import layout
from kiln.core.errors import IntegrityError, StoreConflict
from kiln.core.forwards.forward_keys import ForwardSpec
from kiln.core.plan.job import ExportJob, HostSpec
from kiln.core.trust.layout import artifact_key, compile_log_key, inspection_key, vouch_key, worker_memory_key
from kiln.core.trust.vouch import make_vouch
from kiln.host.processes import faults
from kiln.host.compile import tuner
from kiln.host.machine.cache import local_path
from kiln.host.compile.compiler import CompilePool, CompileResult
from kiln.host.leases.leasing import Leases, compile_leased
from kiln.host.processes.procs import PeakSampler
from kiln.store import ObjectMissing

log = logging.getLogger(__name__)


def compile_on_host(store, job: ExportJob, host: HostSpec, specs: list[ForwardSpec], workers: int) -> dict:
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

    from kiln.core.machine.home import kiln_home
    from kiln.host.trust.signers import export_signer

    signer = export_signer(job.signing, kiln_home(), host.name)  # before any compile: a host without the key stops
    entries = tuner.load_for_compile(store, specs, torch.__version__)
    leases = Leases(store, f"{job.export_id}:{host.name}", job.recipe.lease_ttl_s)
    uploaded: list[dict] = []
    reused: list[dict] = []

    def upload(result: CompileResult) -> None:
        spec = by_key[result.key]
        store.put_json(worker_memory_key(spec, result.key), {"compile_peak_mib": result.peak_mib,
                                                             "compile_s": round(result.compile_s, 3),
                                                             "shapes": str(spec.shapes)}, overwrite=True)
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

    def job_of(spec: ForwardSpec) -> tuple[dict, str]:  # what a compile worker gets: plain data
        return spec.to_dict(), str(local_path(host, spec.key))

    by_key = {s.key: s for s in specs}
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
    may be loaded is the reader's check of their vouch (kiln.core.trust.vouch).

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


def compile_records(store, job: ExportJob, keys: list[str]) -> dict[str, dict]:
    """key -> the compile record this export wrote for it; a key another export compiled has none."""
    out = {}
    for key in keys:
        try:
            out[key] = store.get_json(compile_log_key(job.export_id, key))
        except ObjectMissing:
            pass
    return out


def break_leases(store, job: ExportJob, keys: list[str], hosts: set[str]) -> int:
    """Drop the leases that `hosts` (lost mid-compile) of this export hold on `keys`; returns how many."""
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
