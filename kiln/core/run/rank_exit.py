"""What `kiln verify` and `kiln run` say when a rank process ends without a result. Pure.

A rank that segfaults or is OOM-killed posts nothing; its parent sees only
its exit status, as multiprocessing reports it (`Process.exitcode`: N for
`exit(N)`, -S for death by signal S), and what the rank last said it was
doing (e.g. 'running forward 4x32'). These functions turn that into the
one-line message of kiln.core.errors.RankDied or RanksTimedOut.
"""

from __future__ import annotations

import signal

HINTS = {
    signal.SIGKILL: "A SIGKILL nobody sent by hand is most often the kernel's out-of-memory killer (see dmesg)",
    signal.SIGSEGV: "A crash in native code (the compiled forward, torch or gloo)",
    signal.SIGBUS: "A crash in native code, or a file it had mapped shrank (a package or checkpoint rewritten)",
    signal.SIGABRT: "Native code aborted (its message, if any, is above on stderr)",
}
"""Why a rank most likely died of a signal, for the signals a crash or the OOM killer sends."""


def describe_exit(exitcode: int) -> str:
    """'signal SIGKILL (-9)' for a negative (multiprocessing's death-by-signal) code, else 'exit code N'."""
    if exitcode < 0:
        try:
            name = signal.Signals(-exitcode).name
        except ValueError:
            name = str(-exitcode)
        return f"signal {name} ({exitcode})"
    return f"exit code {exitcode}"


def rank_died_message(rank: int, exitcode: int, doing: str, *, world_size: int) -> str:
    """One line: which rank died, how, and while doing what ('' when it had not said yet)."""
    where = f" while {doing}" if doing else " before it said what it was doing"
    hint = HINTS.get(-exitcode) if exitcode < 0 else None
    others = {1: "", 2: "; the other rank was stopped"}.get(
        world_size, f"; the other {world_size - 1} ranks were stopped")
    return (f"rank {rank} died with {describe_exit(exitcode)}{where}{others}."
            + (f" {hint}." if hint else ""))


def ranks_timed_out_message(timeout_s: float, doing: dict[int, str]) -> str:
    """One line: the ranks still running after `timeout_s` and what each last said it was doing."""
    states = ", ".join(f"rank {r} {d or 'had not started'}" for r, d in sorted(doing.items()))
    return (f"the ranks did not finish within {timeout_s:.0f} s ({states}); they were stopped. "
            "A rank waiting on another in gloo waits for it forever: look for one stuck or starved of CPU.")
