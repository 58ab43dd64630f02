"""The processes Kiln starts: they die with their parent, and their memory peak is measured.

Every process Kiln starts (compile workers, rank checks, verify and run
ranks) calls `die_with_parent()` first: a watcher thread in it watches the
process that started it (the pipe multiprocessing keeps to it, and its pid
every `PARENT_POLL_S`), and when that process has
gone, however that one ended (exit, exception, SIGKILL), it kills its own
children and exits, so no worker outlives its export holding the memory the
next export's gate measures. Not the kernel's PR_SET_PDEATHSIG: that fires
when the *thread* that started the process ends, and Kiln starts workers from
Prefect task threads, which end long before the process does.

`PeakSampler` samples the resident memory of a process and its children
(the compiler's g++ processes included) on a thread while work runs, from a
few /proc files per process (not a walk of every process on the host), and
takes the process's own exact peak from the kernel; sampling is I/O, not
compilation, so a thread is fine here.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time

import psutil

from kiln.host.machine.probe import host_memory_bytes

MIB = 2**20
PARENT_POLL_S = 0.5
"""How often a spawned process looks whether the process that started it is still there."""


def die_with_parent() -> None:
    """Make this process die when its parent does (call first thing in a started process).

    The parent is the process that started this one: for a multiprocessing child, the process that asked
    for it (spawned, or forked by a forkserver: kiln.host.compile.worker_start), watched through the pipe it holds
    open for the child (`multiprocessing.parent_process()`'s sentinel), so a forkserver between them does
    not count; for another child, its parent pid, polled every `PARENT_POLL_S`. The parent may die before
    this is called (a spawned worker imports torch first, seconds under load): this process exits at once
    then, before it could be adopted and mistake its new parent for the old one.
    """
    started_by = multiprocessing.parent_process()
    if started_by is not None:
        if not started_by.is_alive():  # the parent died before the watch began
            os._exit(1)
        threading.Thread(target=_watch_sentinel, args=(started_by,), daemon=True, name="kiln-parent-watch").start()
        return
    parent = os.getppid()
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True, name="kiln-parent-watch").start()


def _watch_sentinel(started_by) -> None:
    # The pipe closes when the parent goes, however it ended; a process the parent forked would keep it
    # open, so the parent's pid is looked at too (with its start time: a reused pid is not the parent).
    try:
        parent = psutil.Process(started_by.pid)
        born = parent.create_time()
    except psutil.Error:
        _exit_with_children()
    while started_by.is_alive():
        try:
            if parent.create_time() != born or parent.status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.Error:
            break
        started_by.join(PARENT_POLL_S)
    _exit_with_children()


def _watch_parent(parent: int) -> None:
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    _exit_with_children()


def _exit_with_children() -> None:
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


_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


def tree_rss_bytes(proc: psutil.Process) -> int:
    """Resident bytes of `proc` and all its descendants (those that vanish meanwhile count 0).

    Reads each process's `statm` and its threads' `children` lists under /proc (a few small files per
    process in the tree); where the kernel has no `children` lists, psutil's walk of every process.
    """
    pids = _tree_pids(proc.pid)
    if pids is None:
        return _tree_rss_psutil(proc)
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm", "rb") as f:
                total += int(f.read().split()[1]) * _PAGE_BYTES
        except (OSError, IndexError, ValueError):
            pass
    return total


def _tree_pids(root: int) -> list[int] | None:
    """`root` and its descendants from /proc/PID/task/TID/children; None when the kernel does not list them."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue  # gone
        for tid in tids:
            try:
                with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
                    todo.extend(int(c) for c in f.read().split())
            except FileNotFoundError:
                if pid == root and tid == str(root):
                    return None  # no CONFIG_PROC_CHILDREN
            except (OSError, ValueError):
                pass
    return out


def _tree_rss_psutil(proc: psutil.Process) -> int:
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def _own_peak_bytes() -> int | None:
    """This process's largest resident set since the last `_reset_own_peak` (VmHWM); None where unknown."""
    try:
        with open("/proc/self/status", "rb") as f:
            for line in f:
                if line.startswith(b"VmHWM:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _reset_own_peak() -> bool:
    """Start this process's VmHWM again from its current resident set (Linux >= 4.0); False where it cannot."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


class PeakSampler:
    """Largest resident memory of a process and its children while the `with` block runs (`peak_mib`).

    The tree (the process and every descendant, e.g. the compiler's g++ processes) is sampled every
    `interval_s` from /proc; when the process is this one, its own peak is also the kernel's exact
    high-water mark (VmHWM, reset on entry), so a spike between samples still counts. Also tracks the
    host's smallest available memory over the same time (`min_available_mib`; the cgroup's where it allows
    less than the node, as the probe counts it).
    """

    def __init__(self, interval_s: float = 0.05, pid: int | None = None):
        self.interval_s = interval_s
        self._proc = psutil.Process(pid)
        self._own = pid is None or pid == os.getpid()
        self._hwm = False
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
        self._hwm = self._own and _reset_own_peak()
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()
        own_peak = _own_peak_bytes() if self._hwm else None
        if own_peak is not None:
            self.peak_bytes = max(self.peak_bytes, own_peak)

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
        self._proc = subprocess.Popen([sys.executable, "-m", "kiln.host.processes.procs"], stdin=subprocess.PIPE, text=True,
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


def kill_tree(pid: int) -> None:
    """SIGKILL process `pid` and every descendant it has now (its children first; those gone are skipped):
    what a stopped step started (a compiler's g++, a loader's helpers) must not outlive it."""
    try:
        root = psutil.Process(pid)
        tree = [*root.children(recursive=True), root]
    except psutil.Error:
        return
    for proc in tree:
        try:
            proc.kill()
        except psutil.Error:
            pass


def started_at(pid: int) -> float | None:
    """Start time (epoch seconds) of process `pid` on this host; None when there is no such process."""
    try:
        return psutil.Process(pid).create_time()
    except (psutil.Error, ValueError):
        return None


def this_process() -> dict:
    """This process as a lease holder: {'host', 'pid', 'started_at'} (see kiln.core.run.holders)."""
    import socket

    return {"host": socket.gethostname(), "pid": os.getpid(), "started_at": started_at(os.getpid())}


def holder_started_at(holder: dict) -> float | None:
    """Start time of the process that has `holder`'s pid here now, when `holder` names this host; else None."""
    import socket

    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int):
        return None
    return started_at(pid)
