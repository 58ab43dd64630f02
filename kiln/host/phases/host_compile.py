"""A host's share of the compile phase: compile its forwards under leases in its pool, vouch for and upload
each the moment it is done, record what each compile measured; and the flow's bookkeeping of those
records (compile_records) and of leases held by hosts lost mid-compile (break_leases)."""

from __future__ import annotations

import logging

from kiln.core.errors import IntegrityError, StoreConflict
from kiln.core.forwards.forward_keys import ForwardSpec
from kiln.core.plan.job import ExportJob, HostSpec
from kiln.core.trust import layout
from kiln.core.trust.layout import artifact_key, compile_log_key, vouch_key, worker_memory_key
from kiln.core.trust.signed_record import sign_record
from kiln.core.trust.signing import fingerprint
from kiln.core.trust.vouch import make_vouch
from kiln.host.compile import tuner
from kiln.host.compile.compiler import CompilePool, CompileResult
from kiln.host.leases.leasing import Leases, compile_leased
from kiln.host.machine.cache import local_path
from kiln.host.phases.share import find_trusted
from kiln.host.processes import faults
from kiln.host.processes.procs import PeakSampler
from kiln.store import ObjectMissing

log = logging.getLogger(__name__)


def compile_on_host(store, job: ExportJob, host: HostSpec, specs: list[ForwardSpec], workers: int,
                    deadlines: dict | None = None) -> dict:
    """Compile `specs` in a pool of `workers` spawned processes; upload each the moment it is done.

    Returns {'forwards': one entry per key this host compiled and stored, 'reused': [] (the report's
    shape; a compile never gives way to another's bytes, each stores its own), 'memory': the host's
    lowest available MiB and this process tree's peak MiB (the pool included) while compiling,
    'waited_for_lease': the keys it found leased by another export and waited for}.

    Each key is compiled under a lease shared by the exports of this export's signer (lease_scope),
    taken when its compile is submitted to a worker and renewed while it compiles: a key another export
    of the same signer is compiling right now is waited for (and reused) instead of compiled twice,
    while an export of another signer compiles its own. A lease whose holder is provably gone (expired,
    or its process on this host dead) is taken over. Each compiled forward's worker peak is kept in the
    store per (graph, target), signed, for the gate of later exports. The specs' tuning results are
    fetched and verified first and installed in every worker before it compiles; each entry's
    'autotune' says how many GEMMs were autotuned and how many candidates were benchmarked (0 when the
    stored results covered them). `deadlines` (key -> kiln.core.plan.deadlines.Deadline) bounds each
    compile: the pool kills a worker past it and the forward fails final (kiln.host.compile.compiler).
    """
    import torch

    from kiln.core.machine.home import kiln_home
    from kiln.host.trust.signers import export_signer, export_trusted_keys

    signer = export_signer(job.signing, kiln_home(), host.name)  # before any compile: a host without the key stops
    trusted = export_trusted_keys(job.signing, kiln_home())
    entries = tuner.load_for_compile(store, specs, torch.__version__, trusted)
    leases = Leases(store, f"{job.export_id}:{host.name}", job.recipe.lease_ttl_s, scope=lease_scope(signer))
    uploaded: list[dict] = []

    def upload(result: CompileResult) -> None:
        spec = by_key[result.key]
        if signer is not None:  # an unsigned measurement is acted on by nobody (kiln.core.trust.signed_record)
            store.put_json(worker_memory_key(spec, result.key),
                           sign_record("worker_memory", {"compile_peak_mib": result.peak_mib,
                                                         "compile_s": round(result.compile_s, 3),
                                                         "shapes": str(spec.shapes)}, signer), overwrite=True)
        publish(store, job, host.name, result, signer)
        leases.release(result.key)
        entry = {"key": result.key, "sha256": result.sha256, "size_bytes": result.size_bytes,
                 "compile_s": round(result.compile_s, 3), "compiled_by": host.name, "created": True,
                 "autotune": result.autotune, "attempts": result.attempts, "compile_peak_mib": result.peak_mib}
        store.put_json(compile_log_key(job.export_id, result.key), entry, overwrite=True)
        uploaded.append(entry)
        if entries and result.autotune and result.autotune["benchmarked"]:
            log.warning("forward %s benchmarked %d GEMM candidate(s) while compiling although tuning results "
                        "were installed: some GEMM shape was not tuned", result.key, result.autotune["benchmarked"])
        faults.point("uploaded", len(uploaded))

    def job_of(spec: ForwardSpec) -> tuple[dict, str]:  # what a compile worker gets: plain data
        return spec.to_dict(), str(local_path(host, spec.key))

    by_key = {s.key: s for s in specs}
    with PeakSampler(interval_s=0.2) as sampler, \
            CompilePool(workers, max_attempts=job.recipe.max_compile_attempts, tuning_entries=entries,
                        deadlines=deadlines, where=f"host {host.name}") as pool:
        waited = compile_leased(pool, leases, [job_of(s) for s in specs], upload,
                                stored=lambda key: find_trusted(store, key, trusted)[0] is not None,
                                wait_s=job.recipe.lease_wait_s)
    return {"forwards": uploaded, "reused": [],
            "memory": {"min_available_mib": sampler.min_available_mib, "peak_tree_mib": sampler.peak_mib},
            "waited_for_lease": sorted(waited)}


def lease_scope(signer) -> str:
    """Which exports share compile leases: those of one signer ('unsigned' for unsigned exports). An
    export of another signer would not load this one's packages, so it compiles instead of waiting."""
    return layout.signer_name(fingerprint(signer.public_key())) if signer is not None else "unsigned"


def publish(store, job: ExportJob, host_name: str, result: CompileResult, signer) -> None:
    """Vouch for a compiled forward (signed export: its digest and what it calls), then upload it
    create-once under its key and digest (kiln.core.trust.layout.artifact_key). Other packages at the
    key stay where they are: each compile adds its own, nothing is replaced.

    The vouch goes first, so a package this export stored is never without one, even if the host dies
    right after the upload. Identical bytes stored before (the same digest) are the same package.
    """
    if signer is not None:
        doc = make_vouch(result.key, result.sha256, export_id=job.export_id, compiled_by=host_name,
                         calls=result.calls, signer=signer)
        try:
            store.put_json(vouch_key(result.key, result.sha256, doc["key_fingerprint"]), doc)
        except StoreConflict:  # this signer vouched for identical bytes before: that vouch is as good
            pass
    try:
        store.put_file(artifact_key(result.key, result.sha256), result.path, result.sha256)
    except StoreConflict as exc:
        if exc.existing not in (None, result.sha256):  # other bytes under a digest's name: the store lies
            raise


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
    """Drop the leases that `hosts` (lost mid-compile) of this export hold on `keys`, in any scope;
    returns how many."""
    owners = {f"{job.export_id}:{h}" for h in hosts}
    broken = 0
    for key in keys:
        for obj in store.list(layout.lease_key_prefix(key)):
            parsed = layout.parse(obj)
            if not parsed or parsed["kind"] != "lease" or parsed["key"] != key:
                continue
            try:
                doc = store.get_json(obj)
            except (IntegrityError, ObjectMissing):
                continue
            if doc.get("owner") in owners:
                store.delete(obj)
                broken += 1
    return broken
