"""From probe results to the gate's and KV planner's inputs. Pure."""

from __future__ import annotations

from kiln.gate import HostReport, Plan, decide
from kiln.job import ExportJob
from kiln.sizing import page_bytes, plan_kv, required_mib, worker_capacity


def host_reports(job: ExportJob, probes: list[dict]) -> list[HostReport]:
    """One HostReport per probe, with `--assume-available` figures applied and marked."""
    out = []
    for p in probes:
        assumed = job.assume_available.get(p["name"])
        out.append(HostReport(
            name=p["name"], ranks=tuple(p["ranks"]), num_cpus=p["num_cpus"], target=p["target"],
            available_mib=assumed if assumed is not None else p["memory"]["host_available_mib"],
            available_assumed=assumed is not None, unified=p["unified"],
            device_free_mib=p["memory"]["device_free_mib"], local_keys=frozenset(p["local_keys"])))
    return out


def page_size(job: ExportJob) -> int:
    cfg = job.model_config
    return page_bytes(num_layers=cfg.num_layers, kv_heads_per_rank=cfg.num_kv_heads // job.tp,
                      head_dim=cfg.head_dim, page_tokens=job.recipe.page_tokens, dtype_bytes=cfg.dtype_bytes)


def kv_plan(job: ExportJob, reports: list[HostReport]) -> dict:
    """Pages per rank after weights, activation reserve and (on unified memory) the compile pool."""
    rows = []
    for h in reports:
        workers = min(worker_capacity(job.recipe, available_mib=h.available_mib, unified=h.unified,
                                      num_cpus=h.num_cpus, device_free_mib=h.device_free_mib),
                      len(job.recipe.buckets))
        pool_mib = required_mib(job.recipe, workers, h.unified) if workers and h.unified else 0
        memory_mib = h.available_mib if h.unified or h.device_free_mib is None else h.device_free_mib
        rows.append((list(h.ranks), memory_mib, pool_mib))
    return plan_kv(job.recipe, page_size_bytes=page_size(job),
                   weight_bytes_per_rank=job.model_config.weight_bytes_per_rank(job.tp), hosts=rows).to_dict()


def needed_keys(probes: list[dict]) -> dict[str, list[str]]:
    """target -> the forward keys its hosts need."""
    needed: dict[str, list[str]] = {}
    for p in probes:
        needed.setdefault(p["target"], sorted(s["key"] for s in p["specs"]))
    return needed


def run_gate(job: ExportJob, probes: list[dict], kv: dict | None = None) -> Plan:
    store_keys = {k for p in probes for k in p["store_keys"]}
    return decide(host_reports(job, probes), job.recipe, needed_keys(probes), store_keys,
                  page_size_bytes=page_size(job), kv_pages_per_rank=kv["pages_per_rank"] if kv else None)


def describe(plan: Plan, reports: list[HostReport]) -> str:
    """The table `kiln plan` prints: per host available, required, workers, keys and predicted seconds."""
    rows = [f"gate: {plan.decision} (policy {plan.policy}): {plan.message}",
            f"{'host':<16} {'available':>10} {'1 worker':>9} {'workers':>8} {'compile':>8} {'download':>9} {'predicted':>10}"]
    by_name = {r.name: r for r in reports}
    for name, h in sorted(plan.hosts.items()):
        avail = f"{h.available_mib}{'*' if by_name[name].available_assumed else ''}"
        rows.append(f"{name:<16} {avail:>10} {h.required_one_mib:>9} {h.workers:>8} {len(h.compile):>8} "
                    f"{len(h.download):>9} {h.predicted_s:>9.0f}s")
    if any(r.available_assumed for r in reports):
        rows.append("* assumed (--assume-available)")
    return "\n".join(rows)


def replan_without(job: ExportJob, reports: list[HostReport], lost: set[str], missing: list[str],
                   target_of: dict[str, str]) -> dict[str, tuple[list[str], int]]:
    """host -> (keys, workers) for the `missing` keys over the hosts not `lost` (same gate, same targets)."""
    needed: dict[str, list[str]] = {}
    for key in missing:
        needed.setdefault(target_of[key], []).append(key)
    plan = decide([r for r in reports if r.name not in lost], job.recipe, needed, set())
    return {n: (hp.compile, hp.workers) for n, hp in plan.hosts.items() if hp.compile}
