"""From probe results to the export's decisions: the KV plan, the gate, a replan without lost hosts. Pure.

`decide_export` is the one KV plan -> gate sequence: the flow, `kiln plan`,
`kiln export`'s refusal before Prefect and the bench all call it on their probes.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass, replace

from kiln.core.errors import BadInput, GateRefused, HostsLost
from kiln.core.model.rank_bytes import weight_bytes_per_rank
from kiln.core.plan.gate import HostReport, Plan, check_kv, decide
from kiln.core.plan.job import ExportJob
from kiln.core.plan.probe_result import HostProbe
from kiln.core.plan.recipe import SETTING, SETTINGS, Recipe
from kiln.core.model.cache_layout import cache_layout
from kiln.core.forwards.shape_ranges import parse_shape_range
from kiln.core.plan.sizing import check_peak_mib, device_required_mib, plan_kv, required_mib
from kiln.core.machine.target import device_of, resolve_device


def host_reports(job: ExportJob, probes: list[HostProbe]) -> list[HostReport]:
    """One HostReport per probe, with `--assume-available` figures applied and marked."""
    out = []
    for p in probes:
        assumed = job.assume_available.get(p.name)
        out.append(HostReport(
            name=p.name, ranks=tuple(p.ranks), num_cpus=p.num_cpus, target=p.target,
            available_mib=assumed if assumed is not None else p.host_available_mib,
            available_assumed=assumed is not None, unified=p.unified,
            device_free_mib=p.device_free_mib, device=p.device, local_keys=frozenset(p.local_keys),
            measured_worker_mib=measured_worker_mib(job.recipe, list(p.worker_peaks_mib)),
            measured_peak_mib=max(p.worker_peaks_mib) if p.worker_peaks_mib else None,
            available_source=p.memory_source, cpus_source=p.cpus_source))
    return out


def measured_worker_mib(recipe, peaks_mib: list[int]) -> int | None:
    """The per-worker figure from measured compile peaks of this graph and target: largest x margin."""
    return math.ceil(max(peaks_mib) * recipe.worker_mib_margin) if peaks_mib else None


def page_size(job: ExportJob) -> int:
    """The bytes of one page on the rank that holds the most KV heads (kiln.core.model.shares: where tp splits
    them unevenly, ranks differ), so the page count planned fits every rank."""
    cfg = job.model_config
    return max(cache_layout(cfg, job.tp, job.recipe.max_context_tokens, rank).page_bytes(
        cfg.num_layers, job.recipe.page_tokens, job.recipe.pages_per_seq, cfg.dtype_bytes) for rank in range(job.tp))


def planned_workers(job: ExportJob, probes: list[HostProbe]) -> dict[str, int]:
    """host -> compile workers the gate will start (0 everywhere when it would refuse)."""
    try:
        plan = decide(host_reports(job, probes), job.recipe, needed_keys(probes), _store_keys(probes),
                      compile_s=compile_estimates(job, probes))
    except GateRefused:
        return {p.name: 0 for p in probes}
    return {name: hp.workers for name, hp in plan.hosts.items()}


def cold(probes: list[HostProbe]) -> list[HostProbe]:
    """The same probes with no forward in any host's cache or in the store: a first export of these inputs."""
    return [replace(p, local_keys=(), store_keys=()) for p in probes]


def plan_kv_for(job: ExportJob, probes: list[HostProbe]) -> dict:
    """The KV plan of these probes, reserving the compile workers the gate would start if every forward
    were missing (`cold`): a warm export plans the same pages as a cold one of the same inputs, whichever
    forwards earlier exports left in the store or the caches. (A measured worker peak is an input: once
    the store holds one for this graph and target, the workers are counted at it, as the gate counts them.)"""
    return kv_plan(job, host_reports(job, probes), planned_workers(job, cold(probes)))


def kv_plan(job: ExportJob, reports: list[HostReport], workers: dict[str, int]) -> dict:
    """Pages per rank after weights, activation reserve and, where the KV cache draws from host memory,
    the headroom floor and `workers` compile workers (host -> count; plan_kv_for passes a cold export's).

    The floor is reserved on every such host, compiling or not: it is memory the host keeps free whatever
    else runs. On a discrete GPU the KV cache draws from device memory, which neither the floor nor the
    compile workers' host memory touch; there the compile workers of a CUDA export reserve their device
    memory. A CPU export's KV cache draws from host memory, on a GPU host too."""
    rows = []
    for h in reports:
        cuda = h.device == "cuda"
        on_host = h.unified or not cuda or h.device_free_mib is None
        memory_mib = h.available_mib if on_host else h.device_free_mib
        n = workers.get(h.name, 0)
        pool_mib = required_mib(job.recipe, n, h.unified, h.measured_worker_mib, cuda=cuda) if on_host \
            else device_required_mib(job.recipe, n, h.unified, cuda=cuda)
        rows.append((list(h.ranks), memory_mib, pool_mib))
    plan = plan_kv(job.recipe, page_size_bytes=page_size(job),
                   weight_bytes_per_rank=weight_bytes_per_rank(job.model_config, job.tp), hosts=rows).to_dict()
    plan["pool_workers"] = dict(sorted(workers.items()))
    return plan


def needed_keys(probes: list[HostProbe]) -> dict[str, list[str]]:
    """target -> the forward keys its hosts need."""
    needed: dict[str, list[str]] = {}
    for p in probes:
        needed.setdefault(p.target, sorted(s.key for s in p.specs))
    return needed


RANGE_COMPILE_FACTOR = 1.2
"""How many times a static forward's compile one over a range of shapes takes, before either was measured for
the graph: issue 38 measured 17-19 s for a tiny model's forward over batch and tokens against 46.7 s for three
static ones (15.6 s each)."""


def compile_estimates(job: ExportJob, probes: list[HostProbe]) -> dict[str, float]:
    """key -> the seconds the gate expects each needed forward's compile to take: the median of the compiles
    measured for its graph and target (HostProbe.compile_seconds) of its kind, static or over a range; without
    one, the recipe's compile_s_estimate (times RANGE_COMPILE_FACTOR for a range)."""
    def static(shapes: str) -> bool:
        return parse_shape_range(shapes).static

    measured: dict[tuple[str, bool], list[float]] = {}
    for p in {p.target: p for p in probes}.values():  # hosts of one target read the same records
        for shapes, seconds in p.compile_seconds:
            measured.setdefault((p.target, static(shapes)), []).append(seconds)
    out = {}
    for p in probes:
        for spec in p.specs:
            kind = spec.shapes.static
            seen = measured.get((p.target, kind))
            out[spec.key] = statistics.median(seen) if seen else \
                job.recipe.compile_s_estimate * (1.0 if kind else RANGE_COMPILE_FACTOR)
    return out


def _store_keys(probes: list[HostProbe]) -> set[str]:
    return {k for p in probes for k in p.store_keys}


def run_gate(job: ExportJob, probes: list[HostProbe], kv: dict | None = None) -> Plan:
    """The gate's plan; with `kv`, also refused when the KV plan cannot hold the largest bucket."""
    reports = host_reports(job, probes)
    plan = decide(reports, job.recipe, needed_keys(probes), _store_keys(probes),
                  compile_s=compile_estimates(job, probes), page_size_bytes=page_size(job), kv_pages_per_rank=kv["pages_per_rank"] if kv else None)
    check_rank_checks_fit(job, reports, probes)
    if kv is not None and kv["limiting_rank"] >= 0:
        largest = max(job.recipe.buckets, key=lambda b: (b.batch, b.tokens))
        host = next((r.name for r in reports if kv["limiting_rank"] in r.ranks), "?")
        check_kv(kv["pages_per_rank"], need_pages=largest.batch * job.recipe.pages_per_seq, largest=str(largest),
                 batch=largest.batch, pages_per_seq=job.recipe.pages_per_seq, page_tokens=job.recipe.page_tokens,
                 context_tokens=job.recipe.max_context_tokens, limiting=f"rank {kv['limiting_rank']} on {host}")
    return plan


def check_rank_checks_fit(job: ExportJob, reports: list[HostReport], probes: list[HostProbe]) -> None:
    """GateRefused (exit 3) before anything compiles when a host could not check one of its ranks against
    eager with its forwards (kiln.core.plan.sizing.check_peak_mib; the check itself refuses alike, but only
    after the compile phase): the refusal names each such host and the figures."""
    cfg = job.model_config
    shard_bytes = weight_bytes_per_rank(cfg, job.tp)
    short = []
    for report, probe in zip(reports, probes):
        if not report.ranks or not probe.specs:
            continue
        forwards = len({str(s.shapes) for s in probe.specs})  # a rank loads one per shapes (of its rank shape)
        need = check_peak_mib(shard_bytes=shard_bytes, num_forwards=forwards, half=cfg.dtype != "float32",
                              process_base_mib=job.recipe.process_base_mib)
        if need > report.available_mib:
            short.append(f"host {report.name} needs about {need} MiB to check one rank against eager "
                         f"({forwards} forward(s) of a {shard_bytes // 2**20} MiB shard in {cfg.dtype}) "
                         f"but {report.available_mib} MiB are available")
    if short:
        raise GateRefused("; ".join(short) + ". Nothing was compiled: free memory there, or use a larger tp (a "
                          "smaller shard): a rank holds its weights once whatever its buckets.")


def settings_without_effect(recipe: Recipe, plan: Plan) -> list[str]:
    """The settings changed from their defaults that cannot have mattered, named as the run form names them,
    with why: a setting that matters only when compiling (declared `compiling_only`) in an export with
    nothing to compile (one warning), and worker_device_mib in a CPU export (its compile workers take no
    device memory)."""
    changed = recipe.changed()
    if plan.decision == "nothing_to_do":
        unused = [f"Recipe > '{s.title}' ({s.show(changed[s.name])})" for s in SETTINGS
                  if s.compiling_only and s.name in changed]
        if not unused:
            return []
        return ["nothing to compile (every forward was already in the store), so the gate's and the compiler's "
                f"settings were not needed; these did nothing in this run: {', '.join(unused)}"]
    if "worker_device_mib" in changed and not any(device_of(h.target) == "cuda" for h in plan.hosts.values()):
        title = SETTING["worker_device_mib"].title
        return [f"Recipe > '{title}' ({changed['worker_device_mib']}) did nothing in this run: this is a CPU "
                "export, whose compile workers take no device memory"]
    return []


@dataclass(frozen=True)
class Decision:
    """What the probes decide: the KV plan, and the gate's plan or its refusal (exactly one of the two)."""

    kv_plan: dict
    plan: Plan | None
    refusal: GateRefused | None
    kv_plan_s: float
    gate_s: float


def check_devices(job: ExportJob, probes: list[HostProbe]) -> str:
    """The export's device ('cpu' or 'cuda', kiln.core.machine.target.resolve_device over the rank hosts' GPUs);
    BadInput naming every rank host without a GPU when the recipe says cuda, or when the hosts probed for
    different devices (an auto export whose hosts must be probed again for the device returned)."""
    ranked = [p for p in probes if p.ranks]
    device = resolve_device(job.recipe.device, {p.name: p.num_gpus for p in ranked})
    off = sorted(p.name for p in ranked if p.device != device)
    if off:
        raise BadInput(f"the export's device is {device} but {', '.join(off)} probed for another device; "
                       f"probe them again with device={device}.")
    return device


def decide_export(job: ExportJob, probes: list[HostProbe]) -> Decision:
    """The device check (check_devices: BadInput before anything else), then the KV plan (reserving the
    compile workers a cold export would start), then the gate on it, which also refuses a KV plan that cannot
    hold the largest bucket."""
    check_devices(job, probes)
    start = time.perf_counter()
    kv = plan_kv_for(job, probes)
    kv_s, start = time.perf_counter() - start, time.perf_counter()
    try:
        plan, refusal = run_gate(job, probes, kv), None
    except GateRefused as exc:
        plan, refusal = None, exc
    return Decision(kv_plan=kv, plan=plan, refusal=refusal, kv_plan_s=kv_s, gate_s=time.perf_counter() - start)


def describe(plan: Plan, reports: list[HostReport]) -> str:
    """The table `kiln plan` prints: per host available, required, workers, keys and predicted seconds."""
    rows = [f"gate: {plan.decision} (policy {plan.policy}): {plan.message}",
            f"{'host':<16} {'available':>10} {'per worker':>21} {'1 worker':>9} {'workers':>8} {'compile':>8} "
            f"{'download':>9} {'predicted':>10}"]
    by_name = {r.name: r for r in reports}
    for name, h in sorted(plan.hosts.items()):
        avail = f"{h.available_mib}{'*' if by_name[name].available_assumed else ''}"
        per = f"{h.worker_mib} ({h.worker_mib_source})"
        rows.append(f"{name:<16} {avail:>10} {per:>21} {h.required_one_mib:>9} {h.workers:>8} {len(h.compile):>8} "
                    f"{len(h.download):>9} {h.predicted_s:>9.0f}s")
    if any(r.available_assumed for r in reports):
        rows.append("* assumed (--assume-available)")
    rows += limit_lines(reports)
    return "\n".join(rows)


def limit_lines(reports: list[HostReport]) -> list[str]:
    """One line per figure a cgroup limited (the node's own figures say nothing): which file set it."""
    rows = []
    for r in sorted(reports, key=lambda r: r.name):
        if r.available_source != "host" and not r.available_assumed:
            rows.append(f"{r.name}: available memory limited by {r.available_source}")
        if r.cpus_source != "host":
            rows.append(f"{r.name}: {r.num_cpus} CPUs, limited by {r.cpus_source}")
    return rows


MAX_REPLANS = 3
"""Times the compile phase replans over the hosts left after losing some, before it gives up."""


def replan_after_loss(job: ExportJob, reports: list[HostReport], lost: set[str], missing: list[str],
                      target_of: dict[str, str], replans_done: int) -> dict[str, tuple[list[str], int]]:
    """The next compile assignment after hosts were lost with `missing` keys left: `replan_without`,
    or HostsLost once MAX_REPLANS replans were done (hosts keep disappearing: re-run to resume)."""
    if replans_done >= MAX_REPLANS:
        raise HostsLost(f"hosts kept disappearing during compilation ({', '.join(sorted(lost))}); "
                        f"{len(missing)} forward(s) are still missing. Re-run to resume.")
    return replan_without(job, reports, lost, missing, target_of)


def replan_without(job: ExportJob, reports: list[HostReport], lost: set[str], missing: list[str],
                   target_of: dict[str, str]) -> dict[str, tuple[list[str], int]]:
    """host -> (keys, workers) for the `missing` keys over the hosts not `lost` (same gate, same targets)."""
    needed: dict[str, list[str]] = {}
    for key in missing:
        needed.setdefault(target_of[key], []).append(key)
    plan = decide([r for r in reports if r.name not in lost], job.recipe, needed, set())
    return {n: (hp.compile, hp.workers) for n, hp in plan.hosts.items() if hp.compile}
