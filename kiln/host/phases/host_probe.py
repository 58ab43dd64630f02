"""A host's probe for the gate: its memory, CPUs, GPUs and target, its forward specs, which of them it holds
or the store holds, and what compiles of its graph measured before. Runs on the host it probes."""

from __future__ import annotations

from kiln.core.plan.job import ExportJob, HostSpec
from kiln.core.errors import IntegrityError
from kiln.core.trust.layout import worker_memory_prefix
from kiln.core.trust.signed_record import trusted_body
from kiln.core.plan.probe_result import HostProbe
from kiln.core.machine.target import host_device
from kiln.host.machine import cache, probe
from kiln.host.compile import inductor_cache, tuner
from kiln.host.machine.cache import cache_dir, local_path
from kiln.host.compile.inductor_options import compiler_options, inductor_env
from kiln.host.compile.key_sources import model_code_fingerprint
from kiln.host.phases.host_tidy import tidy_host
from kiln.host.phases.share import find_trusted
from kiln.store import ObjectMissing


def probe_host(job: ExportJob, host: HostSpec, store) -> HostProbe:
    """Memory, CPUs, GPUs, target, this host's forward specs and which of them are local or stored.

    The target is for the recipe's device as this host alone sees it (auto: cuda where it has a GPU; cuda
    on a host without one probes as cpu, and kiln.core.plan.decisions.check_devices refuses the export naming
    every such host). With tuning on, each spec carries the stored tuning results of its GEMMs (verified)
    and its key their digest. `store`: the export's store (opened by the caller). A host whose signing key
    or private Inductor directories (kiln.host.compile.inductor_cache) are wrong stops here (BadInput). What
    earlier runs left on the host is removed first, keeping this export's forwards (kiln.host.phases.host_tidy;
    `tidied` says it).
    """
    import torch

    from kiln.core.machine.home import kiln_home
    from kiln.host.trust.signers import export_signer, export_trusted_keys

    export_signer(job.signing, kiln_home(), host.name)  # every host may compile, so every host needs the key
    trusted = export_trusted_keys(job.signing, kiln_home())
    inductor_cache.prepare(f"host {host.name}")  # and private Inductor caches: refused here, before the gate
    reading = probe.gpu_reading()
    snap = probe.memory_snapshot(reading)
    cpus, cpus_source = probe.cpus_and_source()
    num_gpus = probe.usable_gpus(reading)
    device = host_device(job.recipe.device, num_gpus) if num_gpus else "cpu"
    target_of_host = probe.detect_target(device, reading)
    target = target_of_host.fingerprint
    backends = tuner.tuning_backends(job, device)
    tuned = None if backends is None else tuner.lookup(store, job, target, torch.__version__, backends)
    specs = job.specs(target=target, torch_version=torch.__version__, code=model_code_fingerprint(),
                      compiler={**compiler_options(backends), **target_of_host.inductor_options}, tuning=tuned,
                      inductor_env=inductor_env(), device=device)
    tidied = tidy_host(host, {s.key for s in specs})  # before the cache's free space is read
    return HostProbe(
        name=host.name, ranks=tuple(host.ranks), memory=snap, num_cpus=cpus, cpus_source=cpus_source,
        unified=reading.unified if job.recipe.unified_memory is None else job.recipe.unified_memory,
        target=target, device=device, num_gpus=num_gpus, specs=tuple(specs), cpu_isa=target_of_host.cpu_isa,
        local_keys=tuple(sorted(s.key for s in specs if local_path(host, s.key).exists())),
        # Stored means loadable: a package of the key that a key this export trusts vouched for.
        store_keys=tuple(sorted(s.key for s in specs if find_trusted(store, s.key, trusted)[0] is not None)),
        cache=cache.cache_status(cache_dir(host)), tidied=tidied,
        **measured_compiles(store, specs, trusted))


def measured_compiles(store, specs: list, trusted: dict) -> dict:
    """What compiles of the graph and target of `specs` (one graph per host) measured before, as records a
    key of `trusted` signed (kiln.core.trust.signed_record; any other record is ignored): HostProbe's
    {'worker_peaks_mib': peaks (MiB), 'compile_seconds': (shapes, seconds) of those that recorded them}."""
    peaks, seconds = [], []
    for obj in store.list(worker_memory_prefix(specs[0])) if specs else ():
        try:
            record = trusted_body(store.get_json(obj), "worker_memory", trusted)
            peaks.append(int(record["compile_peak_mib"]))
        except (IntegrityError, ObjectMissing, KeyError, TypeError, ValueError):
            continue  # an unreadable or untrusted record is not a measurement
        if isinstance(record.get("compile_s"), (int, float)) and isinstance(record.get("shapes"), str):
            seconds.append((record["shapes"], float(record["compile_s"])))
    return {"worker_peaks_mib": tuple(peaks), "compile_seconds": tuple(seconds)}
