"""The bench's side effects: a work directory, the servers, and timed subprocess runs.

Purpose: every measured command runs in a subprocess whose wall time the
suite takes around `subprocess.run`, with stdout and stderr in a log file of
the work directory. Contracts: one real Prefect server and one moto S3 server
serve the whole suite, started before any measurement and never charged to
one; each cold measurement gets a fresh TORCHINDUCTOR_CACHE_DIR, KILN_HOME and
store. Pitfalls: Inductor's precompiled headers live in its *default* cache
directory whatever TORCHINDUCTOR_CACHE_DIR says, which Kiln puts under
KILN_INDUCTOR_DIR (kiln.host.compile.inductor_cache); every run gets the one
`inductor_root()` (the caller's KILN_INDUCTOR_DIR, else a directory of the
user's own), so they stay warm for every run after the suite's warm-up; that
is intended (they are built once per machine, not per export).
"""

from __future__ import annotations

import datetime as dt
import os
import re
import shlex
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

PYTHON = sys.executable
KILN = [PYTHON, "-m", "cli.main"]
FAKE_AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": os.devnull, "AWS_SHARED_CREDENTIALS_FILE": os.devnull}


def inductor_root() -> Path:
    """KILN_INDUCTOR_DIR of every run: the caller's, else ~/.cache/kiln-bench/inductor (one per user and
    machine, so the precompiled headers in it outlive a suite run)."""
    configured = os.environ.get("KILN_INDUCTOR_DIR")
    return Path(configured) if configured else Path.home() / ".cache" / "kiln-bench" / "inductor"


_KEY: list[str] = []


def _signing_key() -> str:
    """One Ed25519 key (base64 seed) for every run of this suite."""
    if not _KEY:
        import base64

        from kiln.core.trust.signing import generate
        _KEY.append(base64.b64encode(generate().private_bytes_raw()).decode())
    return _KEY[0]


class BenchFailed(RuntimeError):
    """A measured command did not do what the part needs; the message names its log."""


@dataclass
class Run:
    """One timed subprocess: its wall seconds, exit code and log file."""

    name: str
    wall_s: float
    code: int
    log: Path
    started: dt.datetime
    """Local wall-clock time just before the process started (Prefect's log lines carry local times)."""

    def tail(self, chars: int = 1500) -> str:
        return self.log.read_text(errors="replace")[-chars:]

    def milestones(self, patterns: dict[str, str]) -> dict[str, float | None]:
        """Seconds from the start to the first Prefect log line matching each regex (None: no such line)."""
        out: dict[str, float | None] = {name: None for name in patterns}
        for line in self.log.read_text(errors="replace").splitlines():
            stamp = _LOG_TIME.match(line)
            if not stamp:
                continue
            when = dt.datetime.combine(self.started.date(), dt.time.fromisoformat(stamp.group(1)))
            if when < self.started - dt.timedelta(hours=1):  # the run crossed midnight
                when += dt.timedelta(days=1)
            for name, pattern in patterns.items():
                if out[name] is None and re.search(pattern, line):
                    out[name] = (when - self.started).total_seconds()
        return out

    def expect(self, code: int = 0) -> "Run":
        if self.code != code:
            raise BenchFailed(f"{self.name} exited with {self.code}, expected {code}; log {self.log}:\n{self.tail()}")
        return self


_LOG_TIME = re.compile(r"^(\d\d:\d\d:\d\d\.\d{3}) \| ")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class MotoServer:
    """`moto_server` on loopback (as tests/conftest.py starts it): `endpoint_url`."""

    def __init__(self, log: Path, start_timeout_s: float = 60.0):
        exe = Path(PYTHON).with_name("moto_server")
        if not exe.exists():
            raise BenchFailed(f"moto_server is not installed at {exe}; pip install 'moto[server]'")
        port = free_port()
        self.endpoint_url = f"http://127.0.0.1:{port}"
        with open(log, "wb") as out:
            self.proc = subprocess.Popen([str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=out,
                                         stderr=subprocess.STDOUT)
        deadline = time.monotonic() + start_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise BenchFailed(f"moto_server exited with {self.proc.returncode}; see {log}")
            try:
                urllib.request.urlopen(f"{self.endpoint_url}/moto-api/", timeout=1).close()
                return
            except urllib.error.HTTPError:
                return  # it answered
            except OSError:
                if time.monotonic() > deadline:
                    self.stop()
                    raise BenchFailed(f"moto_server did not answer within {start_timeout_s:.0f} s") from None
                time.sleep(0.2)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class LoadSampler:
    """Samples the 1-minute load average every few seconds while the suite runs."""

    def __init__(self, every_s: float = 5.0):
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every_s,), daemon=True)

    def _run(self, every_s: float) -> None:
        while not self._stop.is_set():
            self.samples.append(os.getloadavg()[0])
            self._stop.wait(every_s)

    def __enter__(self) -> "LoadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(timeout=10)


class Workdir:
    """Directories, environments and timed runs of one suite run."""

    def __init__(self, root: Path, label: str = ""):
        self.root = root
        self.label = label
        self.logs = root / "logs"
        self.logs.mkdir(parents=True, exist_ok=True)
        self.prefect_url: str | None = None
        self.s3_endpoint: str | None = None
        self.commands: list[dict] = []
        self.prefect_home = root / "prefect-home"
        """One Prefect home (the embedded API's database) for every sample: created once, by the warm-up."""

    def child(self, name: str) -> "Workdir":
        """A work directory under this one with the same servers and one command list (a sample's)."""
        child = Workdir(self.root / name, label=name)
        child.prefect_url, child.s3_endpoint, child.commands = self.prefect_url, self.s3_endpoint, self.commands
        child.prefect_home = self.prefect_home
        return child

    def path(self, *parts: str) -> Path:
        p = self.root.joinpath(*parts)
        p.parent.mkdir(parents=True, exist_ok=True)
        return p

    def env(self, *, inductor: str | None, kiln_home: str, server: bool = False) -> dict:
        """A run's environment: its own KILN_HOME and Inductor cache; the suite's Prefect home and S3.

        `server=False` leaves PREFECT_API_URL unset, so Prefect starts its embedded API
        (what a user of one machine gets); True points it at the suite's server.
        """
        env = dict(os.environ)
        for name in ("PREFECT_API_URL", "AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL_S3",
                     "TORCHINDUCTOR_CACHE_DIR"):
            env.pop(name, None)
        env.update(KILN_HOME=str(self.path(kiln_home)), PREFECT_HOME=str(self.prefect_home),
                   KILN_INDUCTOR_DIR=str(inductor_root()),
                   PREFECT_SERVER_ANALYTICS_ENABLED="false", PYTHONUNBUFFERED="1",
                   # A busy machine can take longer than Prefect's default 20 s to start the embedded API.
                   PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="600", **FAKE_AWS,
                   KILN_SIGNING_KEY=_signing_key())  # S3 exports must be signed; local ones sign too
        if inductor is not None:
            env["TORCHINDUCTOR_CACHE_DIR"] = str(self.path("inductor", inductor))
        if self.s3_endpoint:
            env["AWS_ENDPOINT_URL"] = self.s3_endpoint
        if server:
            if not self.prefect_url:
                raise BenchFailed("this part needs the suite's Prefect server, which is not running")
            env["PREFECT_API_URL"] = self.prefect_url
        return env

    def run(self, name: str, argv: list[str], env: dict, timeout_s: float = 3600) -> Run:
        """Run `argv` to completion; wall seconds from just before the process starts to its exit."""
        log = self.logs / f"{name}.log"
        with open(log, "wb") as out:
            out.write(f"$ {shlex.join(argv)}\n".encode())
            out.flush()
            started = dt.datetime.now()
            start = time.perf_counter()
            try:
                code = subprocess.run(argv, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=self.root,
                                      timeout=timeout_s).returncode
            except subprocess.TimeoutExpired:
                code = -9
            wall_s = time.perf_counter() - start
        self.commands.append({"name": name, "sample": self.label or None,
                              "argv": argv[2:] if argv[:2] == [PYTHON, "-m"] else argv, "wall_s": wall_s, "code": code})
        where = f" ({self.label})" if self.label else ""
        print(f"  {name}{where}: {wall_s:.1f} s (exit {code})", file=sys.stderr, flush=True)
        return Run(name, wall_s, code, log, started)

    def inductor_files(self, inductor: str) -> int:
        """Files Inductor wrote under a run's cache directory (0: it compiled nothing)."""
        d = self.root / "inductor" / inductor
        return sum(1 for p in d.rglob("*") if p.is_file()) if d.exists() else 0
