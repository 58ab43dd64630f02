"""Compile workers forked from a server that imported torch, Inductor and Kiln once.

A spawned worker pays seconds of CPU importing torch, Inductor and Kiln before
it compiles anything, and an export starts one per pool slot (and one more for
each worker that dies). Instead each pool's workers come from a forkserver
(`multiprocessing.forkserver`): a fresh interpreter, started with `exec` like a
spawned process, that imports `PRELOAD` once and then forks one worker per
request. What the spawn start gave is kept:

- no inherited threads or CUDA context: the server is a new interpreter (not a
  fork of the caller, whose Prefect and Dask threads and any CUDA context stay
  behind); it runs no torch op and touches no device, and a fork copies only the
  forking thread (numpy's OpenBLAS pool, started at import, stops itself around
  a fork with pthread_atfork);
- the environment: a worker sees the server's environment, fixed when the
  server started, and Inductor reads its `TORCHINDUCTOR_*` settings at import.
  So there is one server per distinct environment (`os.environ` as a whole), and
  a pool asks for the one matching the environment at the time it starts;
  servers for another environment are stopped once no pool uses them;
- dying with the parent: a worker watches the process that asked for it
  (`multiprocessing.parent_process()`), not the server
  (kiln.host.processes.procs.die_with_parent); the server itself exits when every process
  holding its "alive" pipe has gone;
- per-worker memory: a worker's resident set counts the pages it shares with the
  server, as a spawned worker's counted the ones it imported, so the per-worker
  figure the gate uses measures what it did (a slight over-count on the host,
  which the shared pages make cheaper than spawning).

The server's own memory (an idle interpreter with torch imported, mostly shared
with its workers) is one per environment, not one per worker.

The processes that load packages (rank checks, the ranks of `kiln verify` and
`kiln run`) come from a server of their own in the same way, which imports what
a loader needs (kiln.host.ranks.loader.LOADER_PRELOAD, what such a process
imported itself when spawned, so its resident set counts the same modules).
"""

from __future__ import annotations

import hashlib
import io
import os
import threading
from multiprocessing import context as mp_context
from multiprocessing import forkserver, popen_forkserver, reduction, spawn, util

PRELOAD = ["torch", "torch.export", "torch._inductor.compile_fx", "torch._inductor.select_algorithm",
           "kiln.host.model", "kiln.host.compile.tuner", "kiln.host.compile.export_call", "kiln.host.compile.compiler"]
"""Modules each server imports before it forks its first worker: what a compile worker needs."""

_LOCK = threading.Lock()
_SERVERS: dict[str, forkserver.ForkServer] = {}
_USERS: dict[str, int] = {}
_PRELOADS: dict[str, list[str]] = {}


def environment_key(preload: list[str] | None = None) -> str:
    """What a worker inherits from its server that a spawned one would take from the caller now (and, for a
    server of another `preload` than PRELOAD, that list)."""
    ours = repr(sorted(os.environ.items())) + ("" if preload in (None, PRELOAD) else repr(preload))
    return hashlib.sha256(ours.encode()).hexdigest()[:16]


class _Popen(popen_forkserver.Popen):
    """The stdlib's forkserver start, asking this process's server for the worker's environment."""

    def _launch(self, process_obj) -> None:
        server = _SERVERS[process_obj.server_key]
        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        mp_context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            mp_context.set_spawning_popen(None)
        self.sentinel, w = server.connect_to_new_process(self._fds)
        parent_w = os.dup(w)  # the child's sentinel of this process: open while the worker's Popen lives
        self.finalizer = util.Finalize(self, util.close_fds, (parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = forkserver.read_signed(self.sentinel)


class _Process(mp_context.ForkServerProcess):
    server_key = ""

    @staticmethod
    def _Popen(process_obj):
        return _Popen(process_obj)


class WarmContext(mp_context.ForkServerContext):
    """A multiprocessing context whose processes fork from the server for one environment.

    Made by `acquire()`; give it back with `release()` when its pool is closed.
    """

    def __init__(self, key: str):
        self.key = key

    def Process(self, *args, **kwargs) -> _Process:  # noqa: N802  (multiprocessing's spelling)
        process = _Process(*args, **kwargs)
        process.server_key = self.key
        return process


def acquire(preload: list[str] | None = None) -> WarmContext:
    """The context for a pool starting now: the server for the current environment, started if need be
    (asynchronously: the first worker's start waits for its imports). Servers for other environments that
    no pool uses are stopped. `preload`: what the server imports (default PRELOAD, a compile worker's; the
    processes that load packages ask for theirs, kiln.host.ranks.loader.LOADER_PRELOAD)."""
    preload = list(preload or PRELOAD)
    key = environment_key(preload)
    with _LOCK:
        for other in [k for k in _SERVERS if k != key and not _USERS.get(k) and _PRELOADS.get(k) == preload]:
            _stop(_SERVERS.pop(other))
            _PRELOADS.pop(other, None)
        if key not in _SERVERS:
            server = forkserver.ForkServer()
            server.set_forkserver_preload(preload)
            _SERVERS[key] = server
            _PRELOADS[key] = preload
        _SERVERS[key].ensure_running()
        _USERS[key] = _USERS.get(key, 0) + 1
    return WarmContext(key)


def release(ctx: WarmContext) -> None:
    """A pool using `ctx` is closed: its server may be stopped when another environment needs one."""
    with _LOCK:
        _USERS[ctx.key] = max(0, _USERS.get(ctx.key, 0) - 1)


def prepare() -> None:
    """Start the server for the current environment now, so its imports overlap other work."""
    release(acquire())


def server_pids(preload: list[str] | None = None) -> list[int]:
    """Pids of this process's running servers (of those that import `preload`, where given)."""
    with _LOCK:
        return [s._forkserver_pid for k, s in _SERVERS.items()
                if s._forkserver_pid is not None and preload in (None, _PRELOADS.get(k))]


def _stop(server: forkserver.ForkServer) -> None:
    """Ask a server to exit (closing its alive pipe) and reap it in the background: it waits for workers that
    still hold the pipe, which never outlive this process."""
    pid, address = server._forkserver_pid, server._forkserver_address
    if pid is None:
        return
    os.close(server._forkserver_alive_fd)
    server._forkserver_pid = server._forkserver_alive_fd = server._forkserver_address = None
    if address and not util.is_abstract_socket_namespace(address):
        try:
            os.unlink(address)
        except OSError:
            pass
    threading.Thread(target=_reap, args=(pid,), daemon=True, name="kiln-forkserver-reap").start()


def _reap(pid: int) -> None:
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
