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

from kiln import planning
from kiln.cache import check_probed_caches
from kiln.errors import KilnError
from kiln.job import ExportJob, HostSpec
from kiln.keys import artifact_key
from kiln.logs import hide_expected_tracebacks
from kiln.manifest import build_manifest
from kiln.params import ExportParams, default_host_names, prepare
from kiln.report import Report
from flows.hosts import HostRunner
from tasks import phases


class Phases:
    """Times each phase, records it in the report, and takes every host's memory at its end."""

    def __init__(self, report: Report, hosts: list[HostSpec], runner: HostRunner):
        self.report, self.hosts, self.runner = report, hosts, runner
        self.assume: dict[str, int] = {}

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

    def ledger(self, boundary: str) -> None:
        futures = [self.runner.submit(h, phases.memory, host=h) for h in self.hosts]
        for h, fut in zip(self.hosts, futures):
            self.report.memory(h.name, boundary, fut.result(), assumed_available_mib=self.assume.get(h.name))


def _watch_compile(job: ExportJob, futures: list, keys: list[str], log) -> None:
    """Print and publish progress over every host until the compile tasks end."""
    store = phases.hostwork.store_of(job)
    wanted = {artifact_key(k) for k in keys}
    artifact = create_progress_artifact(0.0, description=f"forwards compiled for {job.export_id}")
    shown = -1
    while True:
        finished = all(f.done() for f in futures)
        done = len(wanted.intersection(store.list("forwards/")))
        if done != shown:
            shown = done
            print(f"Compile forwards: {done}/{len(keys)} (all hosts)", file=sys.stderr, flush=True)
            update_progress_artifact(artifact, 100.0 * done / max(1, len(keys)))
        if finished:
            return
        time.sleep(1.0)


@flow(name="kiln-export", log_prints=False)
def export(params: ExportParams) -> dict:
    """Export `params.model` for tensor-parallel inference; returns the report as a dict."""
    hide_expected_tracebacks()
    with HostRunner(dask_address=params.dask, num_local_hosts=params.hosts,
                    local_name=(default_host_names(params) or [None])[0]) as runner:
        job, hosts = prepare(params, host_names=runner.host_names)
        report = Report(job.export_id, model=job.model_name, tp=job.tp, store=job.store_url)
        report.signing = {"signed": job.signing.sign, "key_fingerprint": job.signing.fingerprint,
                          "source": job.signing.source, "signature": None, "note": job.signing.describe()}
        for h in hosts:
            report.host(h.name, ranks=h.ranks)
        phase = Phases(report, hosts, runner)
        try:
            _run(job, hosts, report, phase, runner)
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


def _run(job: ExportJob, hosts: list[HostSpec], report: Report, phase: Phases, runner: HostRunner) -> None:
    log = get_run_logger()
    phase.assume = job.assume_available
    phase.ledger("start")
    with phase("probe"):
        probes = [f.result() for f in [runner.submit(h, phases.probe_host, job=job, host=h) for h in hosts]]
        for p in probes:
            report.host(p["name"], target=p["target"])["cache"] = p["cache"]
        check_probed_caches(probes, job.recipe.artifact_mib_estimate)  # unwritable or full: stop before compiling
    specs = {s["key"]: s for p in probes for s in p["specs"]}
    reports = planning.host_reports(job, probes)
    with phase("tune") as info:
        tuning = phases.tune(job, sorted({p["target"] for p in probes}))
        info["status"] = tuning["status"]
        report.counts["tuning_measured"] = tuning["measured"]
    with phase("kv-plan"):
        report.kv_plan = phases.kv_plan(job, reports)
    report.gate["policy"] = job.recipe.policy
    with phase("gate"):
        try:
            plan = phases.gate(job, probes, report.kv_plan)
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
        futures = [runner.submit(by_name[n], phases.compile_host, job=job, host=by_name[n],
                                 specs=[specs[k] for k in hp.compile], workers=hp.workers)
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
                         "compile_s": c["compile_s"] if c else None,
                         "compile_attempts": c.get("attempts", 1) if c else 0})
    report.forwards = forwards
    report.counts.update(forwards=len(forwards), compiled=len(compiled), reused=len(forwards) - len(compiled))
    with phase("share-verify"):
        mine = {h.name: [f for f in forwards if f["target"] == p["target"]] for h, p in zip(hosts, probes)}
        fetches = [runner.submit(h, phases.share_host, job=job, host=h, forwards=mine[h.name]) for h in hosts]
        for h, f in zip(hosts, fetches):
            report.host(h.name)["downloaded"] = f.result()
        checks = [runner.submit(h, phases.verify_host, job=job, host=h, forwards=mine[h.name]) for h in hosts]
        for h, f in zip(hosts, checks):
            report.verify[h.name] = f.result()
    with phase("manifest"):
        manifest = build_manifest(
            export_id=job.export_id, model={"name": job.model_name, "checkpoint": job.checkpoint, "config": job.config}, recipe=job.recipe.to_dict(),
            tp=job.tp, buckets=[str(b) for b in job.recipe.buckets], forwards=forwards, kv_plan=report.kv_plan,
            hosts=list(report.hosts.values()), phases=list(report.phases), signing=job.signing.manifest_entry())
        report.signing = phases.write_manifest(job, manifest)
        report.manifest = report.signing.pop("manifest")


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
