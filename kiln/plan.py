"""`kiln plan`: probe, KV plan and gate without compiling (and without Prefect)."""

from __future__ import annotations

from kiln import hostwork, planning
from kiln.errors import GateRefused
from kiln.params import ExportParams, prepare


def plan_only(params: ExportParams, host_names: list[str] | None = None) -> dict:
    """The gate's decision for `params`: {'feasible', 'text', 'report'}; nothing is compiled or stored."""
    job, hosts = prepare(params, host_names=host_names)
    probes = [hostwork.probe_host(job, h) for h in hosts]
    reports = planning.host_reports(job, probes)
    kv = planning.kv_plan(job, reports)
    kv_line = f"kv plan: {kv['pages_per_rank']} pages per rank of {kv['page_bytes']} bytes (limited by rank {kv['limiting_rank']})"
    try:
        plan = planning.run_gate(job, probes)
    except GateRefused as exc:
        return {"feasible": False, "text": f"{kv_line}\ngate: refused: {exc}",
                "report": {"decision": "refused", "message": str(exc), "kv_plan": kv}}
    return {"feasible": True, "text": f"{kv_line}\n{planning.describe(plan, reports)}",
            "report": {**plan.to_dict(), "kv_plan": kv}}
