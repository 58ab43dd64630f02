"""The export flow: probe, tune, KV plan, gate, compile, outcome check, share + verify, manifest.

The flow only orchestrates: every decision is a call into kiln's pure core and
every side effect happens in a task on the host it concerns. Progress counts
every host's forwards by watching the store, and the compile phase is OK only
after the outcome check. The report is written whatever happens.
"""

# No `from __future__ import annotations` here: a served flow reaches its run
# process pickled, and Prefect resolves the parameter annotations from the
# function's globals, which then hold only what the body references.
import inspect
import time
from contextlib import contextmanager
from typing import Annotated

from prefect import flow, get_run_logger
from pydantic import Field
from prefect.context import FlowRunContext

from flows import artifacts, model_lease, outcome_events, retry
from flows.compile_phase import run_compile_phase
from flows.hosts import HostRunner
from flows.logs import hide_expected_tracebacks
from flows.params import ExportParams, default_host_names, prepare
from flows.report_out import draw, ledger_key, write_report
from kiln.core.plan import deadlines, decisions, tuning_plan
from kiln.core.model.rank_bytes import weight_bytes_per_rank
from kiln.core.run import outcome
from kiln.core.errors import BadInput, GateRefused, KilnError
from kiln.core.run.retry_rule import worth_retrying
from kiln.core.plan.deadlines import PhaseClock
from kiln.core.plan.gate import Plan
from kiln.core.plan.job import ExportJob, HostSpec
from kiln.core.trust.manifest import export_manifest
from kiln.core.plan.probe_result import HostProbe
from kiln.core.machine.target import resolve_device
from kiln.core.plan.recipe import Recipe
from kiln.core.run.report import Report
from kiln.host.machine import probe
from kiln.host.phases import host_tidy
from kiln.host.weights.rank_weights import check_job_caches
from tasks import phases
from tasks.store import store_of


class Phases:
    """Times each phase, records it in the report, and takes every host's memory at its end."""

    def __init__(self, report: Report, hosts: list[HostSpec], runner: HostRunner, clock: PhaseClock | None = None):
        self.report, self.hosts, self.runner = report, hosts, runner
        self.assume: dict[str, int] = {}
        self.clock = clock or PhaseClock()
        """The phase running now and its deadline, once one is derived (the model lease's renewal reads it)."""

    @contextmanager
    def __call__(self, name: str, **extra):
        start = time.perf_counter()
        self.clock.start(name, None, time.monotonic())
        try:
            yield extra
        except BaseException:
            self.record(name, "failed", time.perf_counter() - start)
            raise
        finally:
            self.clock.stop()
        self.record(name, extra.pop("status", "ok"), time.perf_counter() - start, **extra)

    def record(self, name: str, status: str, duration_s: float, **extra) -> None:
        """One phase's end: in the report, as one line of the run's log, and (unless it failed) the ledger."""
        self.report.phase(name, status, duration_s, **extra)
        estimate = self.report.gate.get("predicted_s")
        against = f" (the gate estimated {estimate:.0f} s)" if name == "compile" and estimate else ""
        (get_run_logger().warning if status == "failed" else get_run_logger().info)(
            "phase %s: %s in %.1f s%s", name, status, duration_s, against)
        if status != "failed":
            self.ledger(name)

    def ledger(self, boundary: str) -> None:
        futures = [self.runner.call(h, probe.memory_snapshot) for h in self.hosts]  # readings, not task runs
        for h, fut in zip(self.hosts, futures):
            self.report.memory(h.name, boundary, fut.result(), assumed_available_mib=self.assume.get(h.name))


def _export_flow(**parameters) -> dict:
    """Export a model for tensor-parallel inference; returns the report as a dict.

    Each try holds the model's lease (one export per model at a time) and
    follows the recipe's flow retries; deterministic errors are not retried.
    Each try ends with the event kiln.export.completed or kiln.export.failed. A run whose last try
    failed with a Kiln error ends Failed with that error as its state message.
    """
    hide_expected_tracebacks()
    try:
        with outcome_events.export_outcome(parameters) as outcome:  # kiln.export.completed or kiln.export.failed
            params = ExportParams(**parameters)
            clock = PhaseClock()  # a try stuck past its phase's deadline stops renewing the model lease
            with retry.resumable(params) as (params, recipe), \
                    model_lease.model_lease(params, recipe.model_lease_s,
                                            overdue=lambda: clock.overdue(time.monotonic())):
                outcome.params, outcome.recipe = params, recipe
                return _export(params, recipe, outcome, clock)
    except Exception as exc:
        # An error no try follows ends the run in a Failed state whose message is the error itself (the
        # run's header and list say it), not Prefect's "Flow run encountered an exception: ..."; a caller
        # in this process still gets the error raised. An error a try follows is raised: Prefect retries it.
        final = retry.final_state(exc)
        if final is None:
            raise
        return final


def _flow_signature() -> inspect.Signature:
    """The flow's parameters are ExportParams' fields, each top-level with its type (bounds included) and
    default, so the run form Prefect renders cannot drift from the CLI."""
    out = []
    for name, f in ExportParams.model_fields.items():
        # The form's label is the field's title (Prefect titles a parameter with its name unless the
        # schema's extra says otherwise).
        annotation = Annotated[(f.annotation, *f.metadata, Field(json_schema_extra={"title": f.title}))]
        out.append(inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation,
                                     default=f.get_default(call_default_factory=True)))
    return inspect.Signature(out, return_annotation=dict)


def _flow_doc() -> str:
    """The flow's docstring with an Args section: Prefect shows each field's description in the form."""
    args = "\n".join(f"    {name}: {' '.join((f.description or '').split())}"
                     for name, f in ExportParams.model_fields.items())
    return f"{inspect.getdoc(_export_flow)}\n\nArgs:\n{args}\n"


_export_flow.__signature__ = _flow_signature()
_export_flow.__doc__ = _flow_doc()
export = flow(name="kiln-export", log_prints=False, retries=Recipe.flow_retries,
              retry_delay_seconds=int(Recipe.flow_retry_delay_s))(_export_flow)
"""The export flow; call it with ExportParams' fields: `export(**params.flow_parameters())`."""


def _export(params: ExportParams, recipe: Recipe, outcome: "outcome_events.ExportOutcome | None" = None,
            clock: PhaseClock | None = None) -> dict:
    """One try of the export: the report is written, and the run's artifacts published, whatever happens;
    `outcome` learns the job and the report (its event is sent by the caller)."""
    with HostRunner(dask_address=params.dask, num_local_hosts=params.hosts,
                    local_name=(default_host_names(params) or [None])[0]) as runner:
        job, hosts = prepare(params, host_names=runner.host_names, recipe=recipe)
        ctx = FlowRunContext.get()
        report = Report.of_job(job, hosts, attempt=ctx.flow_run.run_count if ctx and ctx.flow_run else 1)
        phase = Phases(report, hosts, runner, clock)
        if outcome is not None:
            outcome.job, outcome.report = job, report
        final = False
        try:
            _run(job, hosts, report, phase, runner)
            report.status = "completed"
            final = True
        except BaseException as exc:
            report.status = "failed"
            report.error = str(exc) if isinstance(exc, KilnError) else f"{type(exc).__name__}: {exc}"
            final = report.attempt > recipe.flow_retries or not (
                isinstance(exc, Exception) and worth_retrying(exc, retry_refusals=recipe.retry_refusals))
            raise
        finally:
            picture = _store_ledger_picture(report, job)
            if params.report:
                write_report(report, params.report)
            artifacts.publish(report, job, max_tries=recipe.flow_retries + 1, picture=picture, final=final,
                              changed=_changed_settings(params, recipe))
        _closing_line(report)
    return report.to_dict()


def _changed_settings(params: ExportParams, recipe: Recipe) -> dict[str, str]:
    """{form title: value} of every field and recipe setting of this try that differs from its default."""
    from kiln.core.plan.recipe import SETTING

    out = {ExportParams.model_fields[k].title: v for k, v in params.model_dump(exclude_defaults=True).items()
           if k not in ("recipe", "export_id")}
    out.update({f"Recipe > {SETTING[k].title}": SETTING[k].show(v) for k, v in recipe.changed().items()})
    return {k: str(v) for k, v in out.items()}


def _closing_line(report: Report) -> None:
    """One line a reader copies from the log: which export, where its manifest is, how it is signed."""
    signature = report.signing.get("signature") or "unsigned"
    get_run_logger().info("export %s done: manifest %s; signature %s (key %s)", report.export_id,
                          report.store_url(report.manifest) if report.manifest else "-", signature,
                          report.signing.get("key_fingerprint") or "-")


def _run(job: ExportJob, hosts: list[HostSpec], report: Report, phase: Phases, runner: HostRunner) -> None:
    """The phases of one try, in order: each step below is one phase (kv-plan and gate are one step)."""
    phase.assume = job.assume_available
    if job.image_text:  # an image-text checkpoint: its text decoder is exported
        report.warnings.append(job.image_text["left_out"])
    phase.ledger("start")
    with phase("probe"):
        probes = _probe(job, hosts, runner, report)
    with phase("tune") as info:
        probes = _tune(job, hosts, runner, report, probes, info)
    # Nothing is reused on the store's word: the probes counted only packages a trusted key vouched for; any
    # other package at a needed key is named here and left alone (this export compiles its own).
    untrusted = phases.check_reused(job, sorted({s.key for p in probes for s in p.specs}))
    if untrusted:
        get_run_logger().warning(untrusted)
        report.warnings.append(untrusted)
    plan = _gate(job, probes, report, phase)
    specs = {s.key: s for p in probes for s in p.specs}
    with phase("compile") as info:
        compiled, own = _compile(job, hosts, runner, report, probes, specs, plan, info, phase)
    with phase("outcome-check"):
        report.record_forwards(outcome.forward_records(specs, phases.outcome_check(job, specs, own), compiled,
                                                       job.model_config, job.tp, outcome.target_cpus(probes)),
                               compiled)
    with phase("share-verify"):
        _share_verify(job, hosts, runner, report, probes, phase.clock)
    with phase("manifest"):
        manifest = export_manifest(job, report)
        report.signing = phases.write_manifest(job, manifest)
        report.manifest = report.signing.pop("manifest")
        report.manifest_doc = manifest


def _on_hosts(runner: HostRunner, hosts: list[HostSpec], task, **parameters) -> list:
    """`task` on every host at once; the results in `hosts`' order."""
    return [f.result() for f in [runner.submit(h, task, host=h, **parameters) for h in hosts]]


def _probe(job, hosts, runner, report) -> list[HostProbe]:
    """Every host's probe (each host then removes what earlier runs left there: kiln.host.phases.host_tidy),
    and the store's uploads that killed writers left unfinished are aborted."""
    probes = _on_hosts(runner, hosts, phases.probe_host, job=job)
    try:
        tidied = [p.tidied for p in probes] + [host_tidy.tidy_store(store_of(job), job.store_url)]
    except Exception as exc:  # housekeeping (a store's policy may not allow it): said, never fatal
        tidied = [p.tidied for p in probes]
        get_run_logger().warning("could not abort the store's stale uploads in parts (they stay until aborted, "
                                 "e.g. by a bucket lifecycle rule): %s", exc)
    for line in filter(None, tidied):
        get_run_logger().info(line)
    # The export's device: BadInput naming each rank host without a GPU for device=cuda, before anything
    # compiles. auto with some rank host lacking a GPU means cpu everywhere: probe those that chose cuda again.
    device = resolve_device(job.recipe.device, {p.name: p.num_gpus for p in probes if p.ranks})
    again = [h for h, p in zip(hosts, probes) if p.ranks and p.device != device]
    if again:
        redone = _on_hosts(runner, again, phases.probe_host, job=job.replace(recipe=job.recipe.replace(device=device)))
        by_name = {p.name: p for p in redone}
        probes = [by_name.get(p.name, p) for p in probes]
    report.record_probes(probes)
    check_job_caches(job, probes)  # unwritable or full: stop before compiling
    return probes


def _tune(job, hosts, runner, report, probes, info: dict) -> list[HostProbe]:
    """Once per distinct target, on one of its hosts (the others load the results from the store); new
    results change the forward keys, so the hosts are probed again."""
    by_name = {h.name: h for h in hosts}
    results = [f.result() for f in [runner.submit(by_name[name], phases.tune, job=job, target=target)
                                    for target, name in tuning_plan.tuning_hosts(probes).items()]]
    info.update(tuning_plan.summarize(results))
    report.counts["tuning_measured"] = info["measured"]
    if job.recipe.tuning != "off" and info["status"] == "skipped":
        # A warning only when asked for: the default ('cached') has nothing to tune on CPU hosts, every time.
        asked = job.recipe.tuning != Recipe.tuning
        (get_run_logger().warning if asked else get_run_logger().info)(
            "kernel tuning (%s) measured nothing: %s", job.recipe.tuning, info.get("reason"))
    return _on_hosts(runner, hosts, phases.probe_host, job=job) if any(r["changed"] for r in results) else probes


def _gate(job, probes, report, phase) -> Plan:
    """The KV plan, then the gate on it (two phases of the report); raises the refusal."""
    try:
        decision = phases.decide(job, probes)
    except GateRefused as refusal:
        decision = getattr(refusal, "decision", None)
        if decision is None:
            raise
    report.kv_plan = decision.kv_plan
    phase.record("kv-plan", "ok", decision.kv_plan_s)
    report.gate["policy"] = job.recipe.policy
    if decision.refusal is not None:
        report.gate.update(decision="refused", message=str(decision.refusal))
        report.record_shortfall(decision.refusal.short_hosts)
        phase.record("gate", "failed", decision.gate_s)
        get_run_logger().error("gate: %s", decision.refusal)  # the refusal, said once
        raise decision.refusal
    report.record_plan(decision.plan)
    phase.record("gate", "ok", decision.gate_s)
    log = get_run_logger()
    log.info("gate: %s", decision.plan.message)
    for warning in decisions.settings_without_effect(job.recipe, decision.plan):  # on the console too
        log.warning(warning)
        report.warnings.append(warning)
    return decision.plan


def _compile(job, hosts, runner, report, probes, specs, plan, info: dict, phase: Phases) -> tuple[dict, dict[str, str]]:
    """Compile what the plan assigns; hosts lost midway leave `hosts` (the rest goes on without them).
    Returns (key -> this export's compile record, key -> the sha256 its compiling host returned)."""
    per_key = deadlines.compile_deadlines(decisions.compile_estimates(job, probes), job.recipe)
    compiled, own, lost, during = run_compile_phase(job, hosts, plan, specs, decisions.host_reports(job, probes),
                                                    runner, per_key, phase.clock)
    report.record_compile(during, lost, job.assume_available)
    info["status"] = "ok" if plan.decision == "compile" else "skipped"
    if lost:
        info["lost_hosts"] = sorted(lost)
        hosts[:] = [h for h in hosts if h.name not in lost]
    return compiled, own


def _share_verify(job, hosts, runner, report, probes, clock: PhaseClock) -> None:
    """Each host fetches the forwards of its target it lacks, then checks every rank against eager (each
    check within its deadline, kiln.core.plan.deadlines.check_deadline; the phase's is the slowest host's)."""
    target_of = {p.name: p.target for p in probes}
    mine = {h.name: [f for f in report.forwards if f["target"] == target_of[h.name]] for h in hosts}
    shard_bytes = weight_bytes_per_rank(job.model_config, job.tp)
    clock.start("share-verify", max((deadlines.checks_deadline([len(mine[h.name])] * len(h.ranks), shard_bytes,
                                                                 job.recipe) for h in hosts),
                                    key=lambda d: d.seconds, default=None), time.monotonic())
    fetches = [runner.submit(h, phases.share_host, job=job, host=h, forwards=mine[h.name]) for h in hosts]
    for h, f in zip(hosts, fetches):
        report.host(h.name)["downloaded"] = f.result()
    checks = [runner.submit(h, phases.verify_host, job=job, host=h, forwards=mine[h.name]) for h in hosts]
    for h, f in zip(hosts, checks):
        result = f.result()
        report.verify[h.name] = result["checks"]
        report.host(h.name)["verify_memory"] = result["memory"]
        if result.get("checkpoint"):
            _same_checkpoint(report, h.name, result["checkpoint"], first=hosts[0].name)


def _same_checkpoint(report: Report, host: str, read: dict, *, first: str) -> None:
    """Record the checkpoint directory's files as host `host` read them; BadInput (final) when another host
    read other content: the export would hold forwards checked against different weights."""
    from kiln.host.weights.rank_weights import changed_content

    if report.checkpoint_identity is None:
        report.checkpoint_identity = read
        return
    changed = changed_content(report.checkpoint_identity, read)
    if changed:
        raise BadInput(f"host {host} reads other checkpoint content at {read['path']} than host {first}: "
                       f"{changed}; give every host the same checkpoint files (copy them, or use s3://).")


def _store_ledger_picture(report: Report, job: ExportJob) -> bytes | None:
    """Draw the memory ledger; store it with the export (the summary links it) once compilation began.

    An export that stopped before compiling (bad input, a refusal, a full
    cache) leaves the store untouched: its picture is only shown in the run.
    """
    try:
        png = draw(list(report.hosts.values()), title=f"memory ledger of {report.export_id}")
        if any(p["name"] == "compile" for p in report.phases):
            key = ledger_key(report.export_id, png)
            phases.store_picture(job, key, png)
            report.ledger_picture = key
        return png
    except Exception as exc:  # a picture is a convenience; never fail an export over it
        get_run_logger().warning("could not draw or store the memory ledger picture: %s", exc)
        return None
