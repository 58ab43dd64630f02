"""Compile workers forked from a preloaded server (kiln.host.compile.worker_start) keep what a spawned worker had.

The caller's environment at the time the pool starts (a server per environment), no CUDA context and no
thread but the parent watch, and the die-with-parent chain through the server: a worker of an export
killed with SIGKILL exits, and so does its server.
"""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time

import psutil

from kiln.host.compile import worker_start
from kiln.host.compile.compiler import CompilePool, CompileResult


def report(spec: dict, out_path: str) -> CompileResult:
    """Runs in a worker: what it inherited, as the result's key."""
    import torch

    import threading

    threads = {"os": len(os.listdir("/proc/self/task")), "python": sorted(t.name for t in threading.enumerate())}
    seen = {"env": os.environ.get("KILN_TEST_WORKER_ENV"), "cuda": torch.cuda.is_initialized(), "threads": threads}
    return CompileResult(key=repr(seen), path=out_path, sha256="0" * 64, size_bytes=0, compile_s=0.0,
                         pid=os.getpid())


def where_inductor_writes(spec: dict, out_path: str) -> CompileResult:
    """Runs in a worker: where its Inductor keeps caches, precompiled headers and temporary files."""
    import tempfile

    from torch._inductor import codecache
    from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

    seen = {"cache_dir": cache_dir(), "default_cache_dir": default_cache_dir(), "headers": codecache._HEADER_DIR,
            "tempdir": tempfile.gettempdir(), "TMPDIR": os.environ["TMPDIR"]}
    return CompileResult(key=repr(seen), path=out_path, sha256="0" * 64, size_bytes=0, compile_s=0.0,
                         pid=os.getpid())


def test_a_workers_inductor_keeps_everything_in_the_users_private_dirs(tmp_path, monkeypatch):
    """Not $TMPDIR/torchinductor_$USER, which the server's imports fixed before any worker existed."""
    root = tmp_path / "inductor-root"
    monkeypatch.setenv("KILN_INDUCTOR_DIR", str(root))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    with CompilePool(1, compile_fn=where_inductor_writes) as pool:
        [result] = pool.run([({"key": "k"}, str(tmp_path / "k.pt2"))], lambda r: None)
    seen = eval(result.key)  # noqa: S307  (our own repr of a dict of plain values)
    user_default = str(root / "tmp" / f"torchinductor_{__import__('getpass').getuser()}")
    assert seen == {"cache_dir": str(root / "cache"), "default_cache_dir": user_default,
                    "headers": f"{user_default}/precompiled_headers", "tempdir": str(root / "tmp"),
                    "TMPDIR": str(root / "tmp")}
    assert all(stat.S_IMODE(os.stat(d).st_mode) == 0o700 for d in (root, root / "cache", root / "tmp"))
    assert "TORCHINDUCTOR_CACHE_DIR" not in os.environ, "the pool's owner keeps its own environment"


def _seen(tmp_path) -> tuple[dict, int]:
    with CompilePool(1, compile_fn=report) as pool:
        [result] = pool.run([({"key": "k"}, str(tmp_path / "k.pt2"))], lambda r: None)
    return eval(result.key), result.pid  # noqa: S307  (our own repr of a dict of plain values)


def test_workers_take_the_environment_of_their_pool_and_nothing_else(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_TEST_WORKER_ENV", "first")
    first, _ = _seen(tmp_path)
    [server_first] = worker_start.server_pids(worker_start.PRELOAD)  # a loader's server may run beside it
    again, _ = _seen(tmp_path)
    assert worker_start.server_pids(worker_start.PRELOAD) == [server_first], "one environment, one server"
    monkeypatch.setenv("KILN_TEST_WORKER_ENV", "second")
    second, _ = _seen(tmp_path)
    assert first["env"] == again["env"] == "first" and second["env"] == "second"
    assert worker_start.server_pids(worker_start.PRELOAD) != [server_first], "a server for another environment was kept"
    for seen in (first, second):
        assert seen["cuda"] is False
        assert seen["threads"] == {"os": 2, "python": ["MainThread", "kiln-parent-watch"]}, seen["threads"]


def _what_it_started_with() -> dict:
    return {"pid": os.getpid(), "torch": "torch" in sys.modules, "loader": "kiln.host.ranks.loader" in sys.modules}


def test_a_loader_forks_from_a_server_of_its_own_beside_the_compile_workers(tmp_path):
    """A rank's process (kiln.host.phases.rank_check, kiln.host.ranks.verify_ranks) forks from a server that
    imported LOADER_PRELOAD; asking for it leaves the compile workers' server of the same environment alone."""
    from kiln.host.processes.spawned import call_in_spawned
    from kiln.host.ranks.loader import LOADER_PRELOAD

    _seen(tmp_path)
    [compile_server] = worker_start.server_pids(worker_start.PRELOAD)
    ctx = worker_start.acquire(LOADER_PRELOAD)
    try:
        got = call_in_spawned(_what_it_started_with, context=ctx)
    finally:
        worker_start.release(ctx)
    assert got["pid"] != os.getpid() and got["torch"] and got["loader"], got
    [loader_server] = worker_start.server_pids(LOADER_PRELOAD)
    assert worker_start.server_pids(worker_start.PRELOAD) == [compile_server] != [loader_server]
    _seen(tmp_path)
    assert worker_start.server_pids(worker_start.PRELOAD) == [compile_server], "its server started once"
    assert worker_start.server_pids(LOADER_PRELOAD) == [loader_server], "a compile pool stopped the loader's server"


OWNER = """
import sys, threading, time
from pathlib import Path

from kiln.host.compile.compiler import CompilePool, CompileResult
from kiln.host.compile import worker_start


def hold(spec, out_path):
    import os
    Path(spec["mark"]).write_text(str(os.getpid()))
    time.sleep(120)


if __name__ == "__main__":
    pool = CompilePool(1, compile_fn=hold)
    threading.Thread(target=pool.run, args=([({"key": "k", "mark": sys.argv[1]}, sys.argv[1] + ".pt2")],
                                           print), daemon=True).start()
    while not Path(sys.argv[1]).exists():
        time.sleep(0.05)
    print(" ".join(map(str, worker_start.server_pids())), flush=True)
    time.sleep(120)
"""


def test_a_worker_and_its_server_die_with_the_export_killed(tmp_path):
    script, mark = tmp_path / "owner.py", tmp_path / "worker.pid"
    script.write_text(OWNER)
    owner = subprocess.Popen([sys.executable, str(script), str(mark)], stdout=subprocess.PIPE, text=True,
                             stderr=subprocess.DEVNULL)
    left = []
    try:
        [server] = map(int, owner.stdout.readline().split())
        worker = int(mark.read_text())
        assert psutil.Process(worker).ppid() == server, "the worker was not forked by the server"
        owner.send_signal(signal.SIGKILL)
        owner.wait(30)
        deadline = time.monotonic() + 30
        for pid in (worker, server):
            while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                if time.monotonic() > deadline:
                    left.append(pid)
                    break
                time.sleep(0.1)
    finally:
        owner.kill()
        for pid in left:
            os.kill(pid, signal.SIGKILL)
    assert not left, f"still running 30 s after their export was killed: {left}"
