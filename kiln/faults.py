"""Test-only fault injection, off unless its environment variable is set.

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
    if match != "*" and spec["bucket"] != match and not spec["key"].startswith(match):
        return
    directory = os.environ.get(FAULT_DIR_ENV)
    if not directory:
        raise RuntimeError(f"{KILL_COMPILE_ENV} needs {FAULT_DIR_ENV} (a directory for its markers)")
    if _claim(Path(directory), f"kill-compile-{spec['key']}", count):
        os.kill(os.getpid(), signal.SIGKILL)


def fired(directory: Path | str, prefix: str = "kill-compile-") -> list[str]:
    """Names of the markers of faults that fired (for tests)."""
    d = Path(directory)
    return sorted(p.name for p in d.glob(f"{prefix}*")) if d.is_dir() else []
