"""The C++ runner (runner/kiln_runner.cpp) in tests: built once by `make runner-build`, run as ranks."""

from __future__ import annotations

import fcntl
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RUNNER = REPO / "runner" / "build" / "kiln_runner"


def build_runner() -> Path:
    """The runner, built by `make runner-build` as `make runner` builds it (an up-to-date build costs ~1 s);
    skips the test, naming what is missing, where it cannot be built. Test processes build one at a time
    (a lock file beside the build directory)."""
    missing = subprocess.run(["make", "-s", "runner-missing"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split()  # the Makefile's one list of what the build needs
    if missing:
        pytest.skip(f"cannot build the C++ runner without {', '.join(missing)} (make runner installs them via apt)")
    step = ["make", "-s", "runner-build", f"BIN={Path(sys.executable).parent}"]  # this interpreter's libtorch
    with open(REPO / "runner" / ".build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        proc = subprocess.run(step, cwd=REPO, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(step)}:\n{proc.stdout[-4000:]}{proc.stderr[-4000:]}"
    assert RUNNER.is_file(), f"{' '.join(step)} built no {RUNNER}"
    return RUNNER


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def runner_command(runner: Path, manifest: Path, packages: Path, bucket: str, tokens: list[int], out: Path,
                   rank: int, world_size: int, port: int, extra: tuple[str, ...] = ()) -> list[str]:
    """The command line of one rank of one runner step (`extra`: more flags, e.g. --verify-key FILE)."""
    return [str(runner), "--manifest", str(manifest), "--packages", str(packages), "--bucket", bucket,
            "--tokens", ",".join(map(str, tokens)), "--rank", str(rank), "--world-size", str(world_size),
            "--master-addr", "127.0.0.1", "--master-port", str(port), "--timeout-s", "120", "--out", str(out),
            *extra]


# Two ranks on a 2-core machine; the keys a rank trusts are the ones a test gives it, not the caller's.
RUNNER_ENV = {**{k: v for k, v in os.environ.items() if k != "KILN_VERIFY_KEY"}, "OMP_NUM_THREADS": "1"}


def run_ranks(runner: Path, manifest: Path, packages: Path, bucket: str, tokens: list[int], out: Path,
              world_size: int = 2, extra: tuple[str, ...] = (), env: dict | None = None) -> list[tuple[int, str]]:
    """(exit code, stderr) of each rank of one runner step; rank r writes `out` with {rank} = r. `env`: more
    environment (KILN_VERIFY_KEY)."""
    port = free_port()
    procs = [subprocess.Popen(runner_command(runner, manifest, packages, bucket, tokens, out, rank, world_size, port,
                                             extra),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**RUNNER_ENV, **(env or {})})
             for rank in range(world_size)]
    results = []
    for proc in procs:
        try:
            _, stderr = proc.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        results.append((proc.returncode, stderr))
    return results
