"""The processes Kiln starts: they die with their parent, and their memory peak is measured.

Every process Kiln spawns (compile workers, rank checks, verify and run
ranks) calls `die_with_parent()` first: a watcher thread in it polls its
parent's pid every `PARENT_POLL_S`, and when the process that started it has
gone, however that one ended (exit, exception, SIGKILL), it kills its own
children and exits, so no worker outlives its export holding the memory the
next export's gate measures. Not the kernel's PR_SET_PDEATHSIG: that fires
when the *thread* that started the process ends, and Kiln starts workers from
Prefect task threads, which end long before the process does.

`PeakSampler` samples the resident memory of a process and its children
(the compiler's g++ processes included) on a thread while work runs; sampling
is I/O, not compilation, so a thread is fine here.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import psutil

from kiln.host.probe import host_memory_bytes

MIB = 2**20
PARENT_POLL_S = 0.5
"""How often a spawned process looks whether the process that started it is still there."""


def die_with_parent() -> None:
    """Make this process die when its parent does (call first thing in a spawned process).

    The parent is the process that started this one: for a multiprocessing child, the pid it was started
    from. Its parent may die before this is called (a worker imports torch first, seconds under load); it
    has then been adopted, and its new parent would pass for the old one: it exits at once instead.
    """
    started_by = multiprocessing.parent_process()
    parent = started_by.pid if started_by is not None else os.getppid()
    if os.getppid() != parent:  # the parent died before the watch began
        os._exit(1)
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True, name="kiln-parent-watch").start()


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    try:
        children = psutil.Process().children(recursive=True)
    except psutil.Error:
        children = []
    for child in children:  # what this process started would be orphaned in turn
        try:
            child.kill()
        except psutil.Error:
            pass
    os._exit(1)


def tree_rss_bytes(proc: psutil.Process) -> int:
    """Resident bytes of `proc` and all its descendants (those that vanish meanwhile count 0)."""
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


class PeakSampler:
    """Largest resident memory of this process and its children while the `with` block runs (`peak_mib`).

    Also tracks the host's smallest available memory over the same time (`min_available_mib`; the
    cgroup's where it allows less than the node, as the probe counts it).
    """

    def __init__(self, interval_s: float = 0.05, pid: int | None = None):
        self.interval_s = interval_s
        self._proc = psutil.Process(pid)
        self.peak_bytes = 0
        self.min_available_bytes: int | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="kiln-peak-sampler")

    def _sample(self) -> None:
        self.peak_bytes = max(self.peak_bytes, tree_rss_bytes(self._proc))
        available = host_memory_bytes()[0]
        if self.min_available_bytes is None or available < self.min_available_bytes:
            self.min_available_bytes = available

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> "PeakSampler":
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()

    @property
    def peak_mib(self) -> int:
        return -(-self.peak_bytes // MIB)

    @property
    def min_available_mib(self) -> int | None:
        return None if self.min_available_bytes is None else self.min_available_bytes // MIB


class Reaper:
    """Kills what a process started, directly or not, if that process dies without cleaning up.

    A `die_with_parent()` child cannot outlive its parent, but processes that
    libraries start for us (Prefect's embedded API server) do not call it. The
    reaper is a small separate process: this one tells it, every half second,
    which descendants it has (pid and start time, so a reused pid is never
    killed). When this process dies (SIGKILL, crash) the pipe breaks and the
    reaper kills every descendant it was told about that is still running.
    When it ends normally it says so, and the reaper gives those descendants
    `grace_s` to finish on their own (a server shutting down) before it kills
    what is left (a leaked worker would hold memory, and the caller's pipes).
    """

    def __init__(self, interval_s: float = 0.5):
        import subprocess
        import sys

        # Its own session (a Ctrl-C to ours does not stop it) and no share in our output pipes.
        self._proc = subprocess.Popen([sys.executable, "-m", "kiln.host.procs"], stdin=subprocess.PIPE, text=True,
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        self._me = psutil.Process()
        self._known: set[tuple[int, float]] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval_s,), daemon=True, name="kiln-reaper")
        self._thread.start()

    def _run(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            self.report()

    def report(self) -> None:
        """Tell the reaper about descendants it has not heard of yet."""
        for child in self._me.children(recursive=True):
            try:
                ident = (child.pid, child.create_time())
            except psutil.Error:
                continue
            if ident not in self._known and child.pid != self._proc.pid:
                self._known.add(ident)
                try:
                    self._proc.stdin.write(f"{ident[0]} {ident[1]!r}\n")
                    self._proc.stdin.flush()
                except (OSError, ValueError):
                    return

    def close(self) -> None:
        """This process is ending normally: the reaper kills what is left after its grace period."""
        self._stop.set()
        self._thread.join()
        try:
            self._proc.stdin.write("done\n")
            self._proc.stdin.close()
        except (OSError, ValueError):
            pass  # it keeps watching on its own; nobody waits for it


def _reap(grace_s: float = 10.0) -> None:
    """The reaper's main: read 'PID CREATE_TIME' lines; at 'done' wait `grace_s`, at end of input at once,
    then kill every one still running."""
    import sys

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the whole group; outlive it to clean up
    known = []
    deadline = 0.0  # the pipe broke: at once
    for line in sys.stdin:
        if line.strip() == "done":
            deadline = time.monotonic() + grace_s
            break
        pid, created = line.split()
        known.append((int(pid), float(created)))
    procs = []
    for pid, created in known:
        try:
            proc = psutil.Process(pid)
            if proc.create_time() == created:
                procs.append(proc)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=max(0.0, deadline - time.monotonic()))
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass


if __name__ == "__main__":
    _reap()


def started_at(pid: int) -> float | None:
    """Start time (epoch seconds) of process `pid` on this host; None when there is no such process."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, ValueError):
        return None


def this_process() -> dict:
    """This process as a lease holder: {'host', 'pid', 'started_at'} (see kiln.core.holders)."""
    import socket

    return {"host": socket.gethostname(), "pid": os.getpid(), "started_at": started_at(os.getpid())}


def holder_started_at(holder: dict) -> float | None:
    """Start time of the process that has `holder`'s pid here now, when `holder` names this host; else None."""
    import socket

    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int):
        return None
    return started_at(pid)
