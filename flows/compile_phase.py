"""The compile phase across hosts: run each host's share, count progress over all, survive lost hosts.

Each host compiles its assigned keys in its own pool and uploads each artifact
the moment it is done. The flow watches the store, so progress counts every
host. When a host's worker disappears mid-compile, its unfinished keys are
planned again (by the same pure gate) over the hosts still there, of the same
target; what the lost host already uploaded is kept.

Every round of the phase has a deadline derived from the plan
(kiln.core.plan.deadlines.compile_phase_deadline; each forward's compile has
its own, which its host's pool enforces). When it passes with hosts still
compiling, the flow gives up on them: their tasks are cancelled, the compile
leases they hold on their unfinished forwards are broken (others need not wait
out lease_ttl_s), and the phase fails final naming them.
"""

from __future__ import annotations

import itertools
import sys
import time

from prefect import get_run_logger
from prefect.artifacts import update_progress_artifact

from flows import artifacts
from flows.hosts import HostRunner
from kiln.core.plan import decisions
from kiln.core.plan.deadlines import Deadline, PhaseClock, compile_phase_deadline
from kiln.core.run import outcome
from kiln.core.trust import layout
from kiln.core.forwards.forward_keys import ForwardSpec
from kiln.core.plan.gate import HostReport, Plan
from kiln.core.plan.job import ExportJob, HostSpec
from tasks import phases
from tasks.store import store_of


def run_compile_phase(job: ExportJob, hosts: list[HostSpec], plan: Plan, specs: dict[str, ForwardSpec],
                      reports: list[HostReport], runner: HostRunner, deadlines: dict[str, Deadline],
                      clock: PhaseClock | None = None
                      ) -> tuple[dict[str, dict], dict[str, str], set[str], dict]:
    """Compile what `plan` assigns; returns (key -> compile record of this export, key -> the sha256 its
    compiling host's task returned, lost host names, host -> {'memory': its lowest available MiB and its
    compile process tree's peak MiB while compiling, 'waited_for_lease': keys it waited for while
    another export compiled them, 'reused': keys another compile stored first}). Each compile record
    must carry the sha256 its host's task returned (IntegrityError otherwise). `deadlines`: key -> the
    deadline of one compile of it (kiln.core.plan.deadlines.compile_deadlines); each round's phase
    deadline is derived from them and set on `clock`. DeadlinePassed when a round runs past it."""
    log = get_run_logger()
    store = store_of(job)
    by_name = {h.name: h for h in hosts}
    to_compile = sorted(k for hp in plan.hosts.values() for k in hp.compile)
    progress = _Progress(job, store, to_compile)
    progress.assign({n: hp.compile for n, hp in plan.hosts.items() if hp.compile})
    lost: set[str] = set()
    memory: dict[str, dict] = {}
    reported: dict[str, str] = {}  # key -> sha256, as the compiling host's task returned it
    assignment = {n: (hp.compile, hp.workers) for n, hp in plan.hosts.items() if hp.compile}
    for round_ in itertools.count():
        deadline = compile_phase_deadline(assignment, deadlines, job.recipe)
        until = time.monotonic() + deadline.seconds
        if clock is not None:
            clock.start("compile", deadline, time.monotonic())
        running = {n: runner.submit(by_name[n], phases.compile_host, job=job, host=by_name[n],
                                    specs=[specs[k] for k in keys], workers=workers,
                                    deadlines={k: deadlines[k] for k in keys if k in deadlines})
                   for n, (keys, workers) in assignment.items()}
        gone, late = _watch(running, runner, progress, until)
        if late:
            raise _give_up(job, late, running, runner, progress, assignment, deadline)
        for name in gone:
            runner.cancel(running.pop(name))
        for name, fut in running.items():
            result = fut.result()  # a host's failure fails the phase
            memory[name] = {"memory": result["memory"], "waited_for_lease": result["waited_for_lease"],
                            "reused": sorted(r["key"] for r in result.get("reused", []))}
            reported.update({f["key"]: f["sha256"] for f in result["forwards"]})
        if not gone:
            break
        lost |= gone
        missing = phases.missing_forwards(job, to_compile)
        log.warning("lost host(s) %s mid-compile; %d forward(s) left to compile on the others",
                    ", ".join(sorted(gone)), len(missing))
        if not missing:
            break
        phases.break_leases(job, missing, lost)  # their holders are gone: nobody else must wait out the TTL
        assignment = decisions.replan_after_loss(job, reports, lost, missing,
                                                 {k: specs[k].target for k in missing}, replans_done=round_)
        progress.assign({n: keys for n, (keys, _) in assignment.items()})
    progress.show(final=True)
    # Keys without a record were compiled by another export that held their lease: reused.
    records = phases.compile_records(job, to_compile)
    outcome.check_digests(reported, {k: r["sha256"] for k, r in records.items()}, "the compile record in the store")
    return records, reported, lost, memory


def _watch(running: dict, runner: HostRunner, progress: "_Progress", until: float) -> tuple[set[str], set[str]]:
    """Wait until every host's compile task ends, or a host disappears, or the monotonic time `until`
    passes; returns (the hosts gone, the hosts still compiling at `until`), one of them empty."""
    while True:
        progress.show()
        alive = runner.alive()
        gone = {n for n, f in running.items() if not f.done() and n not in alive}
        if gone or all(f.done() for f in running.values()):
            return gone, set()
        if time.monotonic() > until:
            return set(), {n for n, f in running.items() if not f.done()}
        time.sleep(1.0)


def _give_up(job: ExportJob, late: set[str], running: dict, runner: HostRunner, progress: "_Progress",
             assignment: dict[str, tuple[list[str], int]], deadline: Deadline) -> Exception:
    """The phase ran past `deadline` with hosts `late` still compiling: cancel their tasks, break the
    compile leases they hold on the forwards not stored yet, and return the final error naming them."""
    for name in late:
        runner.cancel(running[name])
    progress.show(final=True)
    keys = {n: assignment[n][0] for n in late}
    unfinished = sorted(k for ks in keys.values() for k in ks if k not in progress.stored)
    try:
        broken = phases.break_leases(job, unfinished, late)
        leases = f"its {broken} compile lease(s) broken" if broken else "it held no compile lease"
    except Exception as exc:  # the deadline is the error to report; the leases expire after lease_ttl_s
        get_run_logger().warning("could not break the compile leases of %s: %s", ", ".join(sorted(late)), exc)
        leases = "its compile leases left to expire (lease_ttl_s)"
    stored = ", ".join(f"{n}: {sum(k in progress.stored for k in keys[n])}/{len(keys[n])} of its forwards stored"
                       for n in sorted(late))
    hosts = "host" + ("s " if len(late) > 1 else " ") + ", ".join(sorted(late))
    return deadline.passed(f"the compile phase on {hosts} ({stored})", f"the flow gave up on it, {leases}")


class _Progress:
    """The live line and the Prefect progress artifact: forwards done over every host, and per host
    (in the artifact's description).

    Each reading asks the store about this export's keys not yet seen stored, at most `per_reading` of
    them (in turn; the final reading asks about all): one listing of a key's packages per key, never a
    listing of every model's forwards.
    """

    def __init__(self, job: ExportJob, store, keys: list[str], per_reading: int = 16):
        self.store, self.keys, self.shown = store, set(keys), -1
        self.stored: set[str] = set()
        self.per_reading = per_reading
        self._pending = sorted(keys)
        self.by_host: dict[str, set[str]] = {}
        self.artifact = artifacts.progress(job.export_id, f"Forwards compiled over all hosts for {job.export_id}") \
            if keys else None

    def assign(self, assignment: dict[str, list[str]]) -> None:
        """Which host compiles which keys (after a host is lost, its keys move to the others)."""
        for keys in self.by_host.values():
            keys.difference_update(k for ks in assignment.values() for k in ks)
        for name, keys in assignment.items():
            self.by_host.setdefault(name, set()).update(keys)

    def _read(self, final: bool) -> None:
        """Ask about the next pending keys; those not stored yet go to the back of the line."""
        ask = self._pending if final else self._pending[:self.per_reading]
        for key in ask:
            try:  # a reading for the progress line, not a phase: a failed one waits for the next
                if self.store.list(layout.artifact_prefix(key)):  # a package of it (a display, not a check)
                    self.stored.add(key)
            except Exception:
                break
        self._pending = self._pending[len(ask):] + [k for k in ask if k not in self.stored]

    def show(self, final: bool = False) -> None:
        if not self.keys:
            return
        self._read(final)
        stored = self.stored
        done = len(self.keys & stored)
        if done != self.shown:
            self.shown = done
            per_host = ", ".join(f"{n} {len(ks & stored)}/{len(ks)}" for n, ks in sorted(self.by_host.items()) if ks)
            print(f"Compile forwards: {done}/{len(self.keys)} (all hosts; {per_host})", file=sys.stderr, flush=True)
            update_progress_artifact(self.artifact, 100.0 * done / len(self.keys),
                                     description=f"Forwards compiled: {done}/{len(self.keys)} over all hosts; "
                                                 f"per host {per_host}")
