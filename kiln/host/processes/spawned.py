"""One call in a fresh spawned process (`call_in_spawned`), stopped once its answer is in; or in a process
forked from a server that imported torch already (its `context`: kiln.host.compile.worker_start's), which
is as fresh (a new interpreter's fork that ran nothing but imports) and starts seconds sooner.

Each rank check and each tuning measurement runs so: native code it loads cannot take the caller down,
and a process that hangs on its way out (an interpreter's teardown after loading native code) cannot hold
the caller up. ProcessPoolExecutor's `max_tasks_per_child` could: its manager thread joins each retired
worker before it starts the next (and CPython gh-115634 is a deadlock in that replacement). The in-flow
check of a gemma2 export once waited 15 minutes in CI after its rank 0 had passed. A caller that passes a
deadline (kiln.core.plan.deadlines) is never held longer than it: a process that has not answered by then is
killed with what it started, and the call fails final naming what was running. The process keeps its
temporary files in a directory of its own (kiln.host.processes.scratch.adopt), removed when it ends, even
killed.
"""

from __future__ import annotations

import multiprocessing
import pickle
import traceback

from kiln.core.plan.deadlines import Deadline
from kiln.host.processes import scratch
from kiln.host.processes.procs import die_with_parent, kill_tree

EXIT_GRACE_S = 30.0
"""How long a process that has answered gets to exit before call_in_spawned kills it."""


class ChildDied(RuntimeError):
    """call_in_spawned's process ended without an answer (a crash, a kill): final, never retried."""

    def __init__(self, exit_code: int | None):
        super().__init__(f"the process ended without an answer (exit code {exit_code})")
        self.exit_code = exit_code


class RemoteTraceback(Exception):
    """The traceback of an exception raised in call_in_spawned's process: the cause of the one raised here."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text

    def __str__(self) -> str:
        return self.text


def call_in_spawned(fn, *args, exit_grace_s: float = EXIT_GRACE_S, deadline: Deadline | None = None,
                    what: str | None = None, context=None):
    """fn(*args) in a fresh spawned process that dies with this one (die_with_parent): its return value, or
    the exception it raised, raised here with the process's traceback as its cause (an exception that cannot
    be pickled comes as a RuntimeError). ChildDied when the process ends without an answer. The process is
    killed if it has not exited `exit_grace_s` after answering.

    With a `deadline`, a process that has not answered within `deadline.seconds` is killed with everything
    it started, and DeadlinePassed (final) names `what` (e.g. 'the check of rank 1 on host h0'; default:
    fn's name) and how the deadline was derived.

    `context`: the multiprocessing context that starts the process (default: spawn's)."""
    ctx = context or multiprocessing.get_context("spawn")
    answers, answer = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_answer, args=(answer, fn, args), daemon=False)
    proc.start()
    answer.close()  # the child's end: when the child dies, recv() below sees EOF
    try:
        try:
            if deadline is not None and not answers.poll(deadline.seconds):  # EOF (a death) counts as ready
                kill_tree(proc.pid)
                proc.join(5)
                raise deadline.passed(what or f"{getattr(fn, '__name__', 'the call')} in a spawned process",
                                      "its process was killed with everything it started")
            ok, value, where = answers.recv()
        except EOFError:
            proc.join(5)
            raise ChildDied(proc.exitcode) from None
    finally:
        answers.close()
        proc.join(exit_grace_s)
        if proc.is_alive():
            kill_tree(proc.pid)
            proc.join(5)
        scratch.remove_if_gone(proc.pid)  # a process killed could not remove its own temporary directory
    if ok:
        return value
    raise value from RemoteTraceback(where)


def _answer(conn, fn, args) -> None:
    """In call_in_spawned's process: call, then send (True, result, None) or (False, exception, its traceback)."""
    die_with_parent()
    scratch.adopt()  # what it and torch write to TMPDIR (AOTInductor's extractions) is swept once it is gone
    try:
        answer = (True, fn(*args), None)
    except BaseException as exc:  # noqa: BLE001 - everything goes back to the caller
        where = "".join(traceback.format_exception(exc))
        answer = (False, exc, where)
        try:
            pickle.dumps(exc)
        except Exception:  # noqa: BLE001 - an exception that cannot travel goes as its traceback
            answer = (False, RuntimeError(where), where)
    conn.send(answer)
    conn.close()
