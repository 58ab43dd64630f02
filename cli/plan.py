"""`kiln plan` and `kiln export`'s fast refusal: probe, KV plan and gate without compiling or Prefect."""

from __future__ import annotations

import time
from collections.abc import Callable

from flows.params import ExportParams, default_host_names, prepare
from kiln.core.plan import decisions
from kiln.core.errors import BadInput, KilnError
from kiln.core.plan.job import ExportJob, HostSpec
from kiln.core.plan.probe_result import HostProbe
from kiln.core.run.report import Report
from kiln.host.phases import host_probe
from kiln.host.machine import probe
from kiln.host.weights.rank_weights import check_job_caches
from tasks.store import store_of


def _probe(job: ExportJob, host: HostSpec) -> HostProbe:
    """One host's probe, where this runs (on its Dask worker for --dask)."""
    return host_probe.probe_host(job, host, store_of(job))


def _probe_all(params: ExportParams) -> tuple:
    """Probe every host: on its Dask worker for --dask; here otherwise (--hosts N stands for this machine)."""
    if not params.dask:
        job, hosts = prepare(params, host_names=default_host_names(params), signing=False)
        return job, [_probe(job, h) for h in hosts]
    from distributed import Client

    from flows.hosts import RESOURCE_PREFIX, HostRunner
    with HostRunner(dask_address=params.dask) as runner:
        job, hosts = prepare(params, host_names=runner.host_names, signing=False)
        with Client(params.dask, timeout=10, set_as_default=False) as client:
            futures = [client.submit(_probe, job, h, pure=False,
                                     resources={f"{RESOURCE_PREFIX}{h.name}": 1}) for h in hosts]
            return job, client.gather(futures)


def plan_only(params: ExportParams) -> dict:
    """The gate's decision for `params`: {'feasible', 'text', 'report'}; nothing is compiled or stored."""
    job, probes = _probe_all(params)
    check_job_caches(job, probes)
    decision = decisions.decide_export(job, probes)
    kv, plan, refusal = decision.kv_plan, decision.plan, decision.refusal
    kv_line = f"kv plan: {kv['pages_per_rank']} pages per rank of {kv['page_bytes']} bytes (limited by rank {kv['limiting_rank']})"
    if refusal is not None:
        return {"feasible": False, "text": f"{kv_line}\ngate: refused: {refusal}",
                "report": {"decision": "refused", "message": str(refusal), "kv_plan": kv}}
    reports = decisions.host_reports(job, probes)
    warnings = "".join(f"\nwarning: {w}" for w in decisions.settings_without_effect(job.recipe, plan))
    return {"feasible": True, "text": f"{kv_line}\n{decisions.describe(plan, reports)}{warnings}",
            "report": {**plan.to_dict(), "kv_plan": kv}}


def refusal_before_flow(job: ExportJob, hosts: list[HostSpec],
                        on_feasible: Callable[[list[HostProbe]], None] | None = None) -> tuple[Report, KilnError] | None:
    """`kiln export` before it starts Prefect: (the failed export's report, the error to raise) if the gate
    refuses or a host's cache cannot take the forwards it lacks (BadInput), else None.

    `hosts` must be this machine (one host, or --hosts N standing for it): they
    are probed here, as `kiln plan` probes them. Tuning is not run: it can only
    change forward keys, so it cannot make a refused export feasible. The
    report has the flow's phases (tune 'skipped') and memory ledger, and
    `gate.decided_in` 'cli'. None: the flow runs and decides
    again (with the model's lease held and tuning done), after calling
    `on_feasible(probes)`.
    """
    report = Report.of_job(job, hosts)
    report.gate["policy"] = job.recipe.policy

    def ledger(boundary: str) -> None:
        snap = probe.memory_snapshot()  # every host is this machine
        for h in hosts:
            report.memory(h.name, boundary, snap, assumed_available_mib=job.assume_available.get(h.name))

    ledger("start")
    start = probe_start = time.perf_counter()
    probes = [_probe(job, h) for h in hosts]
    report.record_probes(probes)
    try:
        check_job_caches(job, probes)
    except BadInput as bad:  # a cache that is unwritable or too full: the flow's probe would stop the same way
        report.phase("probe", "failed", time.perf_counter() - start)
        report.status, report.error = "failed", str(bad)
        return report, bad
    report.phase("probe", "ok", time.perf_counter() - start)
    ledger("probe")
    report.phase("tune", "skipped", 0.0, reason="not run: kiln export refused before starting the flow")
    ledger("tune")
    decision = decisions.decide_export(job, probes)
    report.kv_plan = decision.kv_plan
    report.phase("kv-plan", "ok", decision.kv_plan_s)
    ledger("kv-plan")
    if decision.refusal is None:
        if on_feasible is not None:
            on_feasible(probes)
        return None
    report.phase("gate", "failed", decision.gate_s)
    report.gate.update(decision="refused", message=str(decision.refusal), decided_in="cli",
                       probe_to_decision_s=round(time.perf_counter() - probe_start, 3))
    report.record_shortfall(decision.refusal.short_hosts)
    report.status, report.error = "failed", str(decision.refusal)
    return report, decision.refusal
