"""The export flow: probe, tune, KV plan, gate, compile, outcome check, share + verify, manifest.

The flow only orchestrates: every decision is a call into kiln's pure core and
every side effect happens in a task on the host it concerns. Progress counts
every host's forwards by watching the store, and the compile phase is OK only
after the outcome check. The report is written whatever happens.
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager

from prefect import flow, get_run_logger
from prefect.artifacts import (create_link_artifact, create_markdown_artifact, create_progress_artifact,
                               create_table_artifact, update_progress_artifact)

from kiln import planning, tuning
from kiln.errors import KilnError
from kiln.job import ExportJob, HostSpec
from kiln.keys import artifact_key
from kiln.logs import hide_expected_tracebacks
from kiln.manifest import build_manifest
from kiln.params import ExportParams, prepare
from kiln.report import Report
from tasks import phases


class Phases:
    """Times each phase, records it in the report, and takes every host's memory at its end."""

    def __init__(self, report: Report, hosts: list[HostSpec]):
        self.report, self.hosts = report, hosts

    @contextmanager
    def __call__(self, name: str, **extra):
        start = time.perf_counter()
        try:
            yield extra
        except BaseException:
            self.report.phase(name, "failed", time.perf_counter() - start)
            raise
        status = extra.pop("status", "ok")
        self.report.phase(name, status, time.perf_counter() - start, **extra)
        self.ledger(name)

    def ledger(self, boundary: str, assume: dict[str, int] | None = None) -> None:
        futures = [phases.memory.submit(h) for h in self.hosts]
        for h, fut in zip(self.hosts, futures):
            self.report.memory(h.name, boundary, fut.result(),
                               assumed_available_mib=(assume or {}).get(h.name))


def _watch_compile(job: ExportJob, futures: list, keys: list[str], log) -> None:
    """Print and publish progress over every host until the compile tasks end."""
    store = phases.hostwork.store_of(job)
    wanted = {artifact_key(k) for k in keys}
    artifact = create_progress_artifact(0.0, description=f"forwards compiled for {job.export_id}")
    shown = -1
    while True:
        finished = all(f.state.is_final() for f in futures)
        done = len(wanted.intersection(store.list("forwards/")))
        if done != shown:
            shown = done
            print(f"Compile forwards: {done}/{len(keys)} (all hosts)", file=sys.stderr, flush=True)
            update_progress_artifact(artifact, 100.0 * done / max(1, len(keys)))
        if finished:
            return
        time.sleep(1.0)


@flow(name="kiln-export", log_prints=False)
def export(params: ExportParams, hosts: list[HostSpec] | None = None) -> dict:
    """Export `params.model` for tensor-parallel inference; returns the report as a dict."""
    hide_expected_tracebacks()
    job, default_hosts = prepare(params)
    hosts = hosts or default_hosts
    report = Report(job.export_id, model=job.model_name, tp=job.tp, store=job.store_url)
    for h in hosts:
        report.host(h.name, ranks=h.ranks)
    phase = Phases(report, hosts)
    try:
        _run(job, hosts, report, phase)
        report.status = "completed"
    except BaseException as exc:
        report.status = "failed"
        report.error = str(exc) if isinstance(exc, KilnError) else f"{type(exc).__name__}: {exc}"
        raise
    finally:
        if params.report:
            report.write(params.report)
        _publish(report)
    return report.to_dict()


def _run(job: ExportJob, hosts: list[HostSpec], report: Report, phase: Phases) -> None:
    log = get_run_logger()
    phase.ledger("start", job.assume_available)
    with phase("probe"):
        probes = [f.result() for f in [phases.probe_host.submit(job, h) for h in hosts]]
        for p in probes:
            report.host(p["name"], target=p["target"])
    with phase("tune") as info:
        # Once per distinct target, on one of its hosts; the others load the results from the store.
        runs = [phases.tune.submit(job, target) for target in tuning.tuning_hosts(probes)]
        results = [f.result() for f in runs]
        info.update(tuning.summarize(results))
        report.counts["tuning_measured"] = info["measured"]
        if job.recipe.tuning != "off" and info["status"] == "skipped":
            log.warning("kernel tuning (%s) measured nothing: %s", job.recipe.tuning, info.get("reason"))
        if any(r["changed"] for r in results):  # new results change forward keys: probe them again
            probes = [f.result() for f in [phases.probe_host.submit(job, h) for h in hosts]]
    specs = {s["key"]: s for p in probes for s in p["specs"]}
    reports = planning.host_reports(job, probes)
    with phase("kv-plan"):
        report.kv_plan = phases.kv_plan(job, reports)
    report.gate["policy"] = job.recipe.policy
    with phase("gate"):
        try:
            plan = phases.gate(job, probes)
        except KilnError as exc:
            report.gate.update(decision="refused", message=str(exc))
            raise
        report.gate.update(decision=plan.decision, assignments=plan.assignments, message=plan.message,
                           predicted_s=plan.predicted_s, hosts={n: h.to_dict() for n, h in plan.hosts.items()})
        for name, hp in plan.hosts.items():
            report.host(name, workers=hp.workers)
    log.info("gate: %s", plan.message)
    to_compile = [k for hp in plan.hosts.values() for k in hp.compile]
    compiled: dict[str, dict] = {}
    with phase("compile") as info:
        by_name = {h.name: h for h in hosts}
        futures = [phases.compile_host.submit(job, by_name[n], [specs[k] for k in hp.compile], hp.workers)
                   for n, hp in plan.hosts.items() if hp.compile]
        if futures:
            _watch_compile(job, futures, to_compile, log)
        for f in futures:
            for entry in f.result():
                compiled[entry["key"]] = entry
        info["status"] = "ok" if to_compile else "skipped"
    with phase("outcome-check"):
        stored = phases.outcome_check(job, specs)
    forwards = []
    for key, spec in sorted(specs.items(), key=lambda kv: (kv[1]["target"], kv[1]["bucket"])):
        c = compiled.get(key)
        forwards.append({"key": key, "bucket": spec["bucket"], "target": spec["target"],
                         "sha256": stored[key]["sha256"], "size_bytes": stored[key]["size_bytes"],
                         "object": artifact_key(key), "compiled_by": c["compiled_by"] if c else None,
                         "compile_s": c["compile_s"] if c else None, "autotune": c.get("autotune") if c else None,
                         "tuning": (spec.get("tuning") or {}).get("digest")})
    report.forwards = forwards
    report.counts.update(forwards=len(forwards), compiled=len(compiled), reused=len(forwards) - len(compiled))
    with phase("share-verify"):
        mine = {h.name: [f for f in forwards if f["target"] == p["target"]] for h, p in zip(hosts, probes)}
        fetches = [phases.share_host.submit(job, h, mine[h.name]) for h in hosts]
        for f in fetches:
            f.result()
        checks = [phases.verify_host.submit(job, h, mine[h.name]) for h in hosts]
        for h, f in zip(hosts, checks):
            report.verify[h.name] = f.result()
    with phase("manifest"):
        manifest = build_manifest(
            export_id=job.export_id, model={"name": job.model_name, "checkpoint": job.checkpoint, "config": job.config}, recipe=job.recipe.to_dict(),
            tp=job.tp, buckets=[str(b) for b in job.recipe.buckets], forwards=forwards, kv_plan=report.kv_plan,
            hosts=list(report.hosts.values()), phases=list(report.phases))
        report.manifest = phases.write_manifest(job, manifest)


def _publish(report: Report) -> None:
    """Prefect artifacts of the run: the summary, the forwards table and the manifest's address."""
    try:
        key = report.export_id.lower().replace("_", "-").replace(".", "-")
        create_markdown_artifact(report.markdown(), key=f"{key}-summary"[:200], description="Kiln export summary")
        if report.forwards:
            create_table_artifact([{k: f[k] for k in ("bucket", "key", "sha256", "size_bytes", "compiled_by", "compile_s")}
                                   for f in report.forwards], key=f"{key}-forwards"[:200], description="Forwards")
        if report.manifest:
            create_link_artifact(f"{report.store.rstrip('/')}/{report.manifest}", link_text="manifest",
                                 description="The export's manifest in the store")
    except Exception as exc:  # artifacts are a convenience; never fail an export over them
        get_run_logger().warning("could not publish Prefect artifacts: %s", exc)
