"""Kiln's temporary directories: one per process, under one Kiln root, swept once their owner is gone.

Every temporary directory a Kiln process makes (a loader's private copy `kiln-load-*`, the ranks' meeting
`kiln-ranks-*`, a tuning run's `kiln-tune-*`) and every one torch makes for a process that adopts its
directory as TMPDIR (AOTInductor extracts each package it loads into `aotinductor_*` there, 1.8 MB for the
tiny model, and never removes it when the process is killed) lies in that process's own directory:

    <root>/<pid>-<start time>/      root: KILN_TMP_ROOT, else <the system temp dir>/kiln-<uid>

(kiln.core.run.tidy.owner_dir_name). A process removes its own at a normal exit; one killed leaves it, and
`sweep` (at an export's start on each host, and at the start of `kiln verify` and `kiln run`) removes every
directory whose owner is gone (kiln.core.run.tidy.owner_gone), never a live process's.

Contracts: `adopt()` (first thing in a process that loads packages: call_in_spawned's children, the
ranks of `kiln verify` and `kiln run`) points TMPDIR there and KILN_TMP_ROOT at the root, so what the
process starts keeps to the same root. `mkdtemp(prefix)` makes a directory inside it, for a process
that keeps its TMPDIR.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

from kiln.core.run.tidy import Removed, owner_dir_name, owner_gone, owner_of
from kiln.host.machine.cache import tree_bytes
from kiln.host.processes.procs import started_at

ROOT_ENV = "KILN_TMP_ROOT"
_own: dict[int, Path] = {}  # pid -> its directory (a forked child makes its own)


def root() -> Path:
    """The directory every Kiln process's temporary directory lies in (see the module docstring)."""
    configured = os.environ.get(ROOT_ENV)
    if configured:
        return Path(configured)
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return Path(tempfile.gettempdir()) / f"kiln-{uid}"


def own_dir() -> Path:
    """This process's temporary directory, made (mode 0700) on first use and removed at a normal exit."""
    pid = os.getpid()
    if pid not in _own:
        born = started_at(pid) or 0.0
        path = root() / owner_dir_name(pid, born)
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        _own[pid] = path
        atexit.register(_remove_own, pid)
    return _own[pid]


def _remove_own(pid: int) -> None:
    if os.getpid() == pid and pid in _own:
        shutil.rmtree(_own.pop(pid), ignore_errors=True)


def mkdtemp(prefix: str) -> str:
    """A new temporary directory in this process's own (tempfile.mkdtemp's contract: the caller removes it)."""
    return tempfile.mkdtemp(prefix=prefix, dir=own_dir())


def adopt() -> Path:
    """Make this process's own directory its TMPDIR (what torch and tempfile write under from now on) and
    pass the root on to what it starts; returns the directory."""
    os.environ[ROOT_ENV] = str(root())
    path = own_dir()
    os.environ["TMPDIR"] = str(path)
    tempfile.tempdir = None  # tempfile reads TMPDIR again
    return path


def sweep(where: Path | None = None, *, name_prefix: str = "") -> Removed:
    """Remove the temporary directory of every process that is gone, under the root (`where`), of those whose
    names start with `name_prefix`; returns what was removed. A live owner's directory, or anything not
    named for an owner, is left alone."""
    base = where or root()
    removed = Removed()
    for path in base.glob(f"{name_prefix}*") if base.is_dir() else ():
        owner = owner_of(path.name)
        if owner is None or path.is_symlink() or not path.is_dir():
            continue
        if owner_gone(path.name, started_at(owner[0])):
            size = tree_bytes(path)
            shutil.rmtree(path, ignore_errors=True)
            if not path.exists():
                removed += Removed(1, size)
    return removed


def remove_if_gone(pid: int) -> Removed:
    """Remove the temporary directory of process `pid` once it is gone: what a caller does after its child
    ended, whose own exit could not clean up (a kill, a process stopped on its way out)."""
    return sweep(name_prefix=f"{pid}-")
