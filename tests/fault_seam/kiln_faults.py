"""The test suite's fault seam: hooks on Kiln's fault points (kiln.host.processes.faults), driven by environment
variables so that they reach every process a test starts (compile workers, Dask workers, flow runs).

Installed in each of those processes by sitecustomize.py beside this file (tests/conftest.py puts this
folder first on PYTHONPATH) and in the pytest process by tests/conftest.py. Each hook does nothing
unless its variable is set:

- KILN_FAULT_AFTER_UPLOADS=N: the compile phase raises a transient error
  (ConnectionError, as a dropped connection to the store would) right after
  its N-th upload, once per process. The forwards uploaded so far stay in the
  store; a retry or re-run must compile only the rest.
- KILN_FAULT_PROBE_ERRORS=N: the first N probes in this process fail with a
  transient store error before touching anything.
- KILN_FAULT_DIE_AFTER_UPLOADS=N: the host's process kills itself (SIGKILL)
  right after its N-th upload: a host lost mid-compile.
- KILN_FAULT_CRASH_CHECK=1: a rank check's process kills itself (SIGKILL) before
  it loads anything, as a package that segfaults when loaded takes it down.
- KILN_FAULT_HANG_CHECK=1: a rank check's process hangs (sleeps 600 s) before it
  loads anything, as a package stuck in a collective would.

- KILN_FAULT_HOLD_COMPILE=<path>: a compile worker waits at stage 'export' (after
  torch.export, before Inductor) until <path> exists (600 s at most), so its
  export keeps its compile leases for as long as a test needs.
- KILN_FAULT_MARK_PROBE=<path>: a host's probe creates <path> first: another
  export held by KILN_FAULT_HOLD_COMPILE=<path> goes on once this one has
  looked at the store (and found its forwards missing).

- KILN_FAULT_KILL_RANK=<rank>:<match>: a rank process of `kiln verify` or `kiln run`
  whose rank is <rank> SIGKILLs itself as it starts something whose description
  contains <match> ('running forward 1x16'; 'forward' for its first forward): a rank
  segfaulted or OOM-killed, which posts nothing. With KILN_FAULT_DIR set, it first writes
  the time it dies (time.time()) to kill-rank-<rank> there.

"Once per process" matters: Prefect retries a flow or task in the same
process, so the retry runs without the fault.

KILN_FAULT_KILL_COMPILE=<match>:<count>[:<stage>] makes a compile worker
SIGKILL itself while compiling a forward whose bucket ('1x8') or key starts
with <match> ('*' matches every forward), at most <count> times per forward
over all processes. The stage is 'export' (after torch.export, before Inductor starts;
the default) or 'written' (after the package file is written, before it is
published to the cache). The count is kept with create-once marker files in
KILN_FAULT_DIR, so the fault fires exactly <count> times whatever the number of
workers and retries.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

_fired: dict[str, int] = {}


def _limit(name: str) -> int:
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw.isdigit() else 0


def after_uploads(num_uploaded: int) -> None:
    """At point 'uploaded': a transient error after the KILN_FAULT_AFTER_UPLOADS-th upload, once per process."""
    limit = _limit("KILN_FAULT_AFTER_UPLOADS")
    if limit and num_uploaded >= limit and not _fired.get("uploads"):
        _fired["uploads"] = 1
        raise ConnectionError(f"injected fault (KILN_FAULT_AFTER_UPLOADS={limit}): "
                              f"connection lost after {num_uploaded} upload(s)")


def probe() -> None:
    """Raise a transient store error for the first KILN_FAULT_PROBE_ERRORS calls in this process."""
    limit = _limit("KILN_FAULT_PROBE_ERRORS")
    if _fired.get("probe", 0) < limit:
        _fired["probe"] = _fired.get("probe", 0) + 1
        raise ConnectionError(f"injected fault (KILN_FAULT_PROBE_ERRORS={limit}): store unreachable "
                              f"(probe {_fired['probe']} of {limit})")


def die_after_uploads(num_uploaded: int) -> None:
    """SIGKILL this process once it has uploaded KILN_FAULT_DIE_AFTER_UPLOADS artifacts."""
    limit = _limit("KILN_FAULT_DIE_AFTER_UPLOADS")
    if limit and num_uploaded >= limit:
        os.kill(os.getpid(), signal.SIGKILL)
def crash_check(rank: int) -> None:
    """At point 'check': SIGKILL this rank check's process when KILN_FAULT_CRASH_CHECK is set."""
    if _limit("KILN_FAULT_CRASH_CHECK"):
        os.kill(os.getpid(), signal.SIGKILL)


def hang_check(rank: int) -> None:
    """At point 'check': hang this rank check's process when KILN_FAULT_HANG_CHECK is set."""
    if _limit("KILN_FAULT_HANG_CHECK"):
        import time

        time.sleep(600)


KILL_COMPILE_ENV = "KILN_FAULT_KILL_COMPILE"
FAULT_DIR_ENV = "KILN_FAULT_DIR"
STAGES = ("export", "written")


def parse_kill_compile(value: str) -> tuple[str, int, str]:
    """(match, count, stage) from the variable's value; ValueError when malformed."""
    match, _, rest = value.partition(":")
    count, _, stage = rest.partition(":")
    stage = stage or "export"
    if not match or not count.isdigit() or stage not in STAGES:
        raise ValueError(f"{KILL_COMPILE_ENV}={value!r}: expected MATCH:COUNT[:{'|'.join(STAGES)}]")
    return match, int(count), stage


def _claim(directory: Path, name: str, count: int) -> bool:
    """Take one of `count` create-once markers named `name`; False when all are taken."""
    directory.mkdir(parents=True, exist_ok=True)
    for i in range(count):
        try:
            fd = os.open(directory / f"{name}.{i}", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            continue
        os.write(fd, str(os.getpid()).encode())
        os.close(fd)
        return True
    return False


def maybe_kill_compile(spec: dict, stage: str) -> None:
    """SIGKILL this process if KILN_FAULT_KILL_COMPILE asks for it at `stage` of compiling `spec`."""
    value = os.environ.get(KILL_COMPILE_ENV)
    if not value:
        return
    match, count, want_stage = parse_kill_compile(value)
    if stage != want_stage:
        return
    if match != "*" and spec["shapes"] != match and not spec["key"].startswith(match):
        return
    directory = os.environ.get(FAULT_DIR_ENV)
    if not directory:
        raise RuntimeError(f"{KILL_COMPILE_ENV} needs {FAULT_DIR_ENV} (a directory for its markers)")
    if _claim(Path(directory), f"kill-compile-{spec['key']}", count):
        os.kill(os.getpid(), signal.SIGKILL)


KILL_RANK_ENV = "KILN_FAULT_KILL_RANK"


def maybe_kill_rank(rank: int, doing: str) -> None:
    """SIGKILL this rank process if KILN_FAULT_KILL_RANK names its rank and a part of `doing`."""
    value = os.environ.get(KILL_RANK_ENV)
    if not value:
        return
    want, _, match = value.partition(":")
    if not want.isdigit() or not match:
        raise ValueError(f"{KILL_RANK_ENV}={value!r}: expected RANK:MATCH")
    if int(want) == rank and match in doing:
        import time

        directory = os.environ.get(FAULT_DIR_ENV)
        if directory:
            Path(directory).mkdir(parents=True, exist_ok=True)
            (Path(directory) / f"kill-rank-{rank}").write_text(repr(time.time()))
        os.kill(os.getpid(), signal.SIGKILL)


HOLD_COMPILE_ENV = "KILN_FAULT_HOLD_COMPILE"
MARK_PROBE_ENV = "KILN_FAULT_MARK_PROBE"
HOLD_LIMIT_S = 600.0


def hold_compile(spec: dict, stage: str) -> None:
    """At stage 'export', wait until KILN_FAULT_HOLD_COMPILE's file exists."""
    import time

    path = os.environ.get(HOLD_COMPILE_ENV)
    if not path or stage != "export":
        return
    deadline = time.monotonic() + HOLD_LIMIT_S
    while not Path(path).exists():
        if time.monotonic() > deadline:
            raise RuntimeError(f"{HOLD_COMPILE_ENV}: {path} did not appear within {HOLD_LIMIT_S:.0f} s")
        time.sleep(0.2)


def mark_probe() -> None:
    """Create KILN_FAULT_MARK_PROBE's file (and its folder) as the probe starts."""
    path = os.environ.get(MARK_PROBE_ENV)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).touch()


def fired(directory: Path | str, prefix: str = "kill-compile-") -> list[str]:
    """Names of the markers of faults that fired (for tests)."""
    d = Path(directory)
    return sorted(p.name for p in d.glob(f"{prefix}*")) if d.is_dir() else []


_installed = False


def install_all() -> None:
    """Install every hook on its point in this process (once)."""
    global _installed
    if _installed:
        return
    from kiln.host.processes import faults

    faults.install("probe", mark_probe)
    faults.install("probe", probe)
    faults.install("uploaded", die_after_uploads)
    faults.install("uploaded", after_uploads)
    faults.install("compile", maybe_kill_compile)
    faults.install("compile", hold_compile)
    faults.install("check", crash_check)
    faults.install("check", hang_check)
    faults.install("rank", maybe_kill_rank)
    _installed = True
