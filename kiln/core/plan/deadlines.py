"""Deadlines: how long each step of an export may run before it is stopped and the export fails final.

Every step that could hang has a deadline derived from what the plan predicts for it:

    deadline(step) = max(deadline_floor_s, deadline_margin x predicted_s(step))

    predicted_s(a forward's compile) = its compile estimate (kiln.core.plan.decisions.compile_estimates:
                                       the median measured for its graph and target, else compile_s_estimate)
    predicted_s(a rank check)        = shard MiB / CHECK_READ_MIB_PER_S + forwards x CHECK_S_PER_FORWARD
    predicted_s(a tuning run)        = GEMM shapes x TUNE_S_PER_SHAPE

and the compile phase's (one round: every host's share at once) is what its slowest host could take
if every forward ran to its own deadline, on every one of its max_compile_attempts, plus the time a
host may wait for forwards another export compiles (lease_wait_s):

    phase_s = max over hosts (attempts x (sum(deadlines) / workers + max(deadlines))) + lease_wait_s

(list scheduling's bound: the pool starts a forward whenever a worker is free). A step past its
deadline is stopped by its owner (the compile pool kills the worker, call_in_spawned the process, the
compile phase's watcher gives up on the host) and fails with DeadlinePassed, naming the step, the
host and this derivation; it is never retried (kiln.core.run.retry_rule).

Pure: seconds in, seconds out.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.core.errors import DeadlinePassed
from kiln.core.plan.recipe import Recipe

CHECK_S_PER_FORWARD = 60.0
"""Seconds a rank check is predicted to spend on one forward: load it, run it and eager at its checked shapes."""
CHECK_READ_MIB_PER_S = 50.0
"""MiB per second a rank check is predicted to read its shard at (a slow disk, or S3)."""
TUNE_S_PER_SHAPE = 60.0
"""Seconds a tuning run is predicted to spend benchmarking one GEMM shape's candidates."""


@dataclass(frozen=True)
class Deadline:
    """`seconds` a step may run; `basis` says how they were derived (shown when the deadline passes)."""

    seconds: float
    basis: str

    def passed(self, what: str, done: str = "it was stopped") -> DeadlinePassed:
        """The final error for `what` (e.g. 'the check of rank 1 on host h0') having run past this deadline;
        `done`: what became of it."""
        return DeadlinePassed(
            f"{what} did not finish within {self.seconds:.0f} s ({self.basis}); {done}. A step that "
            "hangs would hang again, so this is final; if it was only slow, raise the recipe's "
            "deadline_margin or deadline_floor_s.")


def bounded(predicted_s: float, recipe: Recipe, what: str) -> Deadline:
    """max(deadline_floor_s, deadline_margin x `predicted_s`), with its basis (`what`: what was predicted)."""
    scaled = recipe.deadline_margin * predicted_s
    if scaled <= recipe.deadline_floor_s:
        return Deadline(recipe.deadline_floor_s, f"deadline_floor_s; {what} predicted {predicted_s:.0f} s")
    return Deadline(scaled, f"deadline_margin {recipe.deadline_margin:g} x {what} predicted {predicted_s:.0f} s")


def compile_deadlines(estimates_s: dict[str, float], recipe: Recipe) -> dict[str, Deadline]:
    """key -> the deadline of one compile of that forward, from its compile estimate."""
    return {key: bounded(s, recipe, "its compile") for key, s in estimates_s.items()}


def compile_phase_deadline(assignment: dict[str, tuple[list[str], int]], deadlines: dict[str, Deadline],
                           recipe: Recipe) -> Deadline:
    """The deadline of one round of the compile phase: `assignment` is host -> (keys it compiles, its
    workers); see the module docstring. A key without a deadline counts the floor."""
    attempts = recipe.max_compile_attempts
    worst, slowest = 0.0, ""
    for host, (keys, workers) in sorted(assignment.items()):
        each = [deadlines[k].seconds if k in deadlines else recipe.deadline_floor_s for k in keys]
        if not each:
            continue
        host_s = attempts * (sum(each) / max(1, workers) + max(each))
        if host_s > worst:
            worst, slowest = host_s, host
    basis = (f"host {slowest}'s forwards over its workers, each up to its compile deadline, "
             f"max_compile_attempts {attempts}, + lease_wait_s {recipe.lease_wait_s:.0f} s" if slowest
             else f"lease_wait_s {recipe.lease_wait_s:.0f} s")
    return Deadline(worst + recipe.lease_wait_s, basis)


def check_deadline(num_forwards: int, shard_bytes: int, recipe: Recipe) -> Deadline:
    """The deadline of one rank's check of `num_forwards` forwards with a shard of `shard_bytes`."""
    predicted = shard_bytes / 2**20 / CHECK_READ_MIB_PER_S + num_forwards * CHECK_S_PER_FORWARD
    return bounded(predicted, recipe, f"a check of {num_forwards} forward(s)")


def checks_deadline(ranks_forwards: list[int], shard_bytes: int, recipe: Recipe) -> Deadline:
    """The deadline of one host's checks, its ranks one after another (`ranks_forwards`: each rank's
    forwards), plus deadline_floor_s for fetching what it lacks first."""
    each = [check_deadline(n, shard_bytes, recipe).seconds for n in ranks_forwards]
    return Deadline(recipe.deadline_floor_s + sum(each),
                    f"deadline_floor_s for the downloads + {len(each)} rank check deadline(s)")


def tune_deadline(num_shapes: int, recipe: Recipe) -> Deadline:
    """The deadline of one tuning run that benchmarks `num_shapes` GEMM shapes."""
    return bounded(num_shapes * TUNE_S_PER_SHAPE, recipe, f"tuning {num_shapes} GEMM shape(s)")


class PhaseClock:
    """The deadline of the phase running now, for whoever must notice from outside that a run is stuck past
    it (the model lease's renewal: kiln.host.leases.lease_wait.hold). Times are the caller's monotonic
    seconds; a phase without a deadline never runs over."""

    def __init__(self) -> None:
        self.phase: str | None = None
        self.deadline: Deadline | None = None
        self.until: float | None = None

    def start(self, phase: str, deadline: Deadline | None, now: float) -> None:
        """`phase` runs from `now`, within `deadline` (None: none)."""
        self.phase, self.deadline = phase, deadline
        self.until = None if deadline is None else now + deadline.seconds

    def stop(self) -> None:
        self.phase = self.deadline = self.until = None

    def overdue(self, now: float) -> str | None:
        """What is past its deadline at `now` ('phase compile is 12 s past its deadline of ...'), else None."""
        if self.until is None or now <= self.until:
            return None
        return (f"phase {self.phase} is {now - self.until:.0f} s past its deadline of {self.deadline.seconds:.0f} s "
                f"({self.deadline.basis})")
