"""The export's phases as Prefect tasks: decorators, retries and a call into Kiln's core.

Purpose: each task is one phase (or one host's share of it). Contracts: the
per-host tasks run on the host they name; reductions (KV plan, gate, outcome
check, manifest) take every host's result. Anti-patterns: decisions in here;
they belong to kiln.core.gate, kiln.core.sizing and kiln.core.manifest. Pitfalls: retries
only on I/O (store transfers); a deterministic error (bad input, a refusal, an
integrity failure) is never retried.
"""

from __future__ import annotations

from prefect import task

from kiln.core import decisions, outcome
from kiln.core.errors import KilnError, VerifyMismatch
from kiln.core.gate import Plan
from kiln.core.job import ExportJob, HostSpec
from kiln.core.layout import manifest_key
from kiln.host import faults, tuner
from tasks import hostwork

IO_RETRY_DELAYS_S = [2, 5, 10]
"""Backoff of the I/O tasks (store and network): three tries more, 17 s in all."""


def transient_only(task, task_run, state) -> bool:
    """retry_condition_fn: retry I/O hiccups, never Kiln's own deterministic errors."""
    try:
        state.result()
    except KilnError:
        return False
    except Exception:
        return True
    return False


@task(name="probe", retries=len(IO_RETRY_DELAYS_S), retry_delay_seconds=IO_RETRY_DELAYS_S,
      retry_condition_fn=transient_only, cache_policy=None)
def probe_host(job: ExportJob, host: HostSpec) -> dict:
    faults.point("probe")
    return hostwork.probe_host(job, host)


@task(name="tune", cache_policy=None)
def tune(job: ExportJob, target: str) -> dict:
    """Kernel tuning for one target, on one host of that target (see kiln.host.tuner.tune_target)."""
    return tuner.tune_target(job, target)


@task(name="kv-plan", cache_policy=None)
def kv_plan(job: ExportJob, probes: list[dict]) -> dict:
    return decisions.plan_kv_for(job, probes)


@task(name="gate", cache_policy=None)
def gate(job: ExportJob, probes: list[dict], kv: dict | None = None) -> Plan:
    return decisions.run_gate(job, probes, kv)


@task(name="compile", cache_policy=None)
def compile_host(job: ExportJob, host: HostSpec, specs: list[dict], workers: int) -> dict:
    """No task retries: a retry would compile its whole share again. A flow retry probes the store
    and compiles only what is missing."""
    return hostwork.compile_on_host(job, host, specs, workers)


@task(name="outcome-check", retries=len(IO_RETRY_DELAYS_S), retry_delay_seconds=IO_RETRY_DELAYS_S,
      retry_condition_fn=transient_only, cache_policy=None)
def outcome_check(job: ExportJob, forwards: dict[str, dict]) -> dict[str, dict]:
    """Every key of the export must be in the store with a sha256, and its package Python-free
    (kiln.core.outcome.check_outcome); returns key -> {'sha256', 'size_bytes', 'calls'}."""
    found, missing = hostwork.stored_forwards(hostwork.store_of(job), sorted(forwards))
    return outcome.check_outcome(found, missing, forwards)


@task(name="share", retries=len(IO_RETRY_DELAYS_S), retry_delay_seconds=IO_RETRY_DELAYS_S,
      retry_condition_fn=transient_only, cache_policy=None)
def share_host(job: ExportJob, host: HostSpec, forwards: list[dict]) -> int:
    return hostwork.fetch_missing(job, host, forwards)


@task(name="verify", cache_policy=None)
def verify_host(job: ExportJob, host: HostSpec, forwards: list[dict]) -> dict:
    result = hostwork.check_ranks(job, host, forwards)
    checks = result["checks"]
    failed = {name: c for name, c in checks.items() if c["diff"] > c["limit"]}
    if failed:
        name, c = max(failed.items(), key=lambda kv: kv[1]["diff"] / kv[1]["limit"])
        raise VerifyMismatch(f"compiled forward {name} on {host.name} differs from eager by {c['diff']:.2e} "
                             f"(scaled; limit {c['limit']:.2e} for {job.model_config.dtype}); the artifact is not "
                             "trustworthy.")
    return result


@task(name="manifest", retries=len(IO_RETRY_DELAYS_S), retry_delay_seconds=IO_RETRY_DELAYS_S,
      retry_condition_fn=transient_only, cache_policy=None)
def write_manifest(job: ExportJob, manifest: dict) -> dict:
    """Sign (the key is loaded here, never passed in) and write the manifest last; the report's signing entry."""
    from blocks.trust import write_signed_manifest
    from kiln.core.home import kiln_home

    store = hostwork.store_of(job)
    entry = write_signed_manifest(store, job.export_id, manifest, job.signing, kiln_home())
    return {**entry, "manifest": manifest_key(job.export_id)}
