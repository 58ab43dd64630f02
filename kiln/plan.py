"""`kiln plan`: probe, KV plan and gate without compiling (and without Prefect)."""

from __future__ import annotations

from kiln import hostwork, planning
from kiln.cache import check_probed_caches
from kiln.errors import GateRefused
from kiln.params import ExportParams, default_host_names, prepare


def _probe_all(params: ExportParams) -> tuple:
    """Probe every host: on its Dask worker for --dask; here otherwise (--hosts N stands for this machine)."""
    if not params.dask:
        job, hosts = prepare(params, host_names=default_host_names(params), signing=False)
        return job, [hostwork.probe_host(job, h) for h in hosts]
    from distributed import Client

    from flows.hosts import RESOURCE_PREFIX, HostRunner
    with HostRunner(dask_address=params.dask) as runner:
        job, hosts = prepare(params, host_names=runner.host_names, signing=False)
        with Client(params.dask, timeout=10, set_as_default=False) as client:
            futures = [client.submit(hostwork.probe_host, job, h, pure=False,
                                     resources={f"{RESOURCE_PREFIX}{h.name}": 1}) for h in hosts]
            return job, client.gather(futures)


def plan_only(params: ExportParams) -> dict:
    """The gate's decision for `params`: {'feasible', 'text', 'report'}; nothing is compiled or stored."""
    job, probes = _probe_all(params)
    check_probed_caches(probes, job.recipe.artifact_mib_estimate)
    reports = planning.host_reports(job, probes)
    kv = planning.plan_kv_for(job, probes)
    kv_line = f"kv plan: {kv['pages_per_rank']} pages per rank of {kv['page_bytes']} bytes (limited by rank {kv['limiting_rank']})"
    try:
        plan = planning.run_gate(job, probes, kv)
    except GateRefused as exc:
        return {"feasible": False, "text": f"{kv_line}\ngate: refused: {exc}",
                "report": {"decision": "refused", "message": str(exc), "kv_plan": kv}}
    return {"feasible": True, "text": f"{kv_line}\n{planning.describe(plan, reports)}",
            "report": {**plan.to_dict(), "kv_plan": kv}}
