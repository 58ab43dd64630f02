"""The compile phase's own deadline (flows/compile_phase.py): the flow's watcher gives up on a host still
compiling when the round's deadline passes, cancels its task, breaks its compile leases on the forwards not
stored yet and fails final naming it. Stand-ins for the hosts, their tasks and the store: no compile."""

from __future__ import annotations

import time

import pytest

from flows import compile_phase
from kiln.core.errors import DeadlinePassed
from kiln.core.plan.deadlines import Deadline
from kiln.core.run.retry_rule import worth_retrying


class Task:
    def __init__(self, done: bool):
        self._done = done

    def done(self) -> bool:
        return self._done


class Runner:
    def __init__(self, alive: set[str]):
        self._alive, self.cancelled = alive, []

    def alive(self) -> set[str]:
        return set(self._alive)

    def cancel(self, future) -> None:
        self.cancelled.append(future)


class Progress:
    def __init__(self, stored: set[str]):
        self.stored = stored

    def show(self, final: bool = False) -> None:
        pass


def test_a_host_still_compiling_at_the_deadline_is_given_up_its_leases_broken(monkeypatch):
    running = {"h0": Task(done=False), "h1": Task(done=True)}
    runner, progress = Runner({"h0", "h1"}), Progress({"a"})
    start = time.monotonic()
    gone, late = compile_phase._watch(running, runner, progress, until=time.monotonic() + 1.5)
    assert (gone, late) == (set(), {"h0"}) and 1.5 <= time.monotonic() - start < 10
    broken = []
    monkeypatch.setattr(compile_phase.phases, "break_leases",
                        lambda job, keys, hosts: broken.append((keys, hosts)) or len(keys))
    err = compile_phase._give_up(None, late, running, runner, progress, {"h0": (["a", "b", "c"], 2), "h1": (["d"], 1)},
                                 Deadline(1.5, "the plan"))
    assert isinstance(err, DeadlinePassed) and not worth_retrying(err)
    assert str(err).startswith("the compile phase on host h0 (h0: 1/3 of its forwards stored) did not finish within "
                               "2 s (the plan); the flow gave up on it, its 2 compile lease(s) broken")
    assert runner.cancelled == [running["h0"]] and broken == [(["b", "c"], {"h0"})]


def test_a_host_gone_before_the_deadline_is_lost_not_late():
    running = {"h0": Task(done=False)}
    assert compile_phase._watch(running, Runner(set()), Progress(set()), until=time.monotonic() + 60) == ({"h0"}, set())


def test_every_host_done_ends_the_watch():
    assert compile_phase._watch({"h0": Task(done=True)}, Runner({"h0"}), Progress(set()), until=0.0) == (set(), set())
