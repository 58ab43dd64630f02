"""The export's phases as Prefect tasks: decorators, retries and a call into Kiln's core.

Purpose: each task is one phase (or one host's share of it). Contracts: the
per-host tasks run on the host they name; reductions (KV plan, gate, outcome
check, manifest) take every host's result. Anti-patterns: decisions in here;
they belong to kiln.core.plan.gate, kiln.core.plan.sizing and kiln.core.trust.manifest. Pitfalls: retries
only on I/O, and only for errors that can heal and that no lower level retried
(kiln.core.run.retry_rule.retry_in_task): a store error has spent the store's
per-request retries and is not retried here; anything else that is not
transient (bad input, a refusal, an integrity failure, a crash, a bug) is
never retried. What escapes an I/O task is marked as retried here, so the
flow does not retry it a third time.
"""

from __future__ import annotations

import functools

from prefect import task

from kiln.core.plan import decisions
from kiln.core.run import outcome
from kiln.core.forwards.forward_keys import ForwardSpec
from kiln.core.plan.job import ExportJob, HostSpec
from kiln.core.trust.layout import manifest_key
from kiln.core.plan.probe_result import HostProbe
from kiln.core.run.retry_rule import mark_retried_in_task, retry_in_task
from kiln.host.processes import faults
from kiln.host.phases import host_compile, host_probe, rank_check, share
from kiln.host.compile import tuner
from tasks.store import store_of

IO_RETRY_DELAYS_S = [2, 5, 10]
"""Backoff of the I/O tasks: three tries more, 17 s in all, for transient errors no lower level retried."""


def transient_only(task, task_run, state) -> bool:
    """retry_condition_fn: retry only what can heal and was not retried per request already
    (kiln.core.run.retry_rule.retry_in_task); a bug or a deterministic error fails at its first try."""
    try:
        state.result()
    except Exception as exc:
        return retry_in_task(exc)
    return False


_IO = dict(retries=len(IO_RETRY_DELAYS_S), retry_delay_seconds=IO_RETRY_DELAYS_S, retry_condition_fn=transient_only,
           cache_policy=None)
"""Every I/O task's retries: transient errors only, with IO_RETRY_DELAYS_S backoff."""


def io_task(name: str):
    """@task(name=name, **_IO) around a function whose exceptions are marked as retried at the task level
    (kiln.core.run.retry_rule.mark_retried_in_task) before they leave it."""
    def decorate(fn):
        @functools.wraps(fn)
        def marked(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except Exception as exc:
                mark_retried_in_task(exc)
                raise
        return task(name=name, **_IO)(marked)
    return decorate


@io_task("probe")
def probe_host(job: ExportJob, host: HostSpec) -> HostProbe:
    faults.point("probe")
    return host_probe.probe_host(job, host, store_of(job))


@task(name="tune", cache_policy=None)
def tune(job: ExportJob, target: str) -> dict:
    """Kernel tuning for one target, on one host of that target (see kiln.host.compile.tuner.tune_target)."""
    return tuner.tune_target(job, target)


@task(name="kv-plan-gate", cache_policy=None)
def decide(job: ExportJob, probes: list[HostProbe]) -> decisions.Decision:
    """The KV plan and the gate's plan (kiln.core.plan.decisions.decide_export); a refusal fails this task run
    (the refusal carries the decision as `.decision`, for the report's KV plan and timings)."""
    decision = decisions.decide_export(job, probes)
    if decision.refusal is not None:
        decision.refusal.decision = decision
        raise decision.refusal
    return decision


@task(name="compile", cache_policy=None)
def compile_host(job: ExportJob, host: HostSpec, specs: list[ForwardSpec], workers: int, deadlines: dict) -> dict:
    """No task retries: a retry would compile its whole share again. A flow retry probes the store
    and compiles only what is missing. `deadlines`: key -> the Deadline of one compile of it."""
    return host_compile.compile_on_host(store_of(job), job, host, specs, workers, deadlines)


def _trusted_keys(job: ExportJob) -> dict:
    from kiln.core.machine.home import kiln_home
    from kiln.host.trust.signers import export_trusted_keys

    return export_trusted_keys(job.signing, kiln_home())


@io_task("check-reused")
def check_reused(job: ExportJob, keys: list[str]) -> str | None:
    """Before the gate: the warning naming packages the store holds at `keys` that no key this export trusts
    vouched for, or None (kiln.host.phases.share.untrusted_note). They are never loaded: the probe counted
    those keys as missing, so this export compiles its own beside them."""
    return share.untrusted_note(store_of(job), keys, _trusted_keys(job))


@io_task("outcome-check")
def outcome_check(job: ExportJob, forwards: dict[str, ForwardSpec], own: dict[str, str]) -> dict[str, dict]:
    """Every key of the export must be in the store with a trusted sha256 (vouched for, or `own`: the
    digest this export's compiling host returned), and its package Python-free
    (kiln.core.run.outcome.check_outcome); returns key -> {'sha256', 'size_bytes', 'calls'}."""
    packages, _ = share.trusted_packages(store_of(job), sorted(forwards), _trusted_keys(job), own)
    found, missing = share.stored_forwards(store_of(job), sorted(forwards), packages)
    return outcome.check_outcome(found, missing, forwards)


@io_task("share")
def share_host(job: ExportJob, host: HostSpec, forwards: list[dict]) -> int:
    return share.fetch_missing(store_of(job), job, host, forwards)


@task(name="verify", cache_policy=None)
def verify_host(job: ExportJob, host: HostSpec, forwards: list[dict]) -> dict:
    result = rank_check.check_ranks(job, host, forwards)
    outcome.check_verified(result["checks"], host.name, job.model_config.dtype)
    return result


@io_task("manifest")
def write_manifest(job: ExportJob, manifest: dict) -> dict:
    """Sign (the key is loaded here, never passed in) and write the manifest last; the report's signing entry."""
    from kiln.host.trust.signers import write_signed_manifest
    from kiln.core.machine.home import kiln_home

    store = store_of(job)
    entry = write_signed_manifest(store, job.export_id, manifest, job.signing, kiln_home())
    return {**entry, "manifest": manifest_key(job.export_id)}


# --- the flow's own store reads and writes: a retried task where a lost read would cost the run; -----
# --- plain calls for bookkeeping (records, the picture), which the flow reads or writes once. ----------


@io_task("missing-forwards")
def missing_forwards(job: ExportJob, keys: list[str]) -> list[str]:
    """The keys without a package in the store this export may load (after hosts were lost mid-compile)."""
    packages, _ = share.trusted_packages(store_of(job), keys, _trusted_keys(job), {})
    return sorted(k for k in keys if k not in packages)


@io_task("break-leases")
def break_leases(job: ExportJob, keys: list[str], hosts: set[str]) -> int:
    """Drop the compile leases lost `hosts` of this export held on `keys` (kiln.host.phases.host_compile.break_leases)."""
    return host_compile.break_leases(store_of(job), job, keys, hosts)


def compile_records(job: ExportJob, keys: list[str]) -> dict[str, dict]:
    """key -> this export's compile record (who compiled it, how long); keys another export compiled are absent."""
    return host_compile.compile_records(store_of(job), job, keys)


def store_picture(job: ExportJob, key: str, png: bytes) -> None:
    store_of(job).put_bytes(key, png)
