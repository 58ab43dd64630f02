"""A Prefect server to talk to: check the one PREFECT_API_URL names, or run a local one.

Several processes (Dask workers) report to Prefect in a multi-host export;
Prefect's embedded API would start one temporary server per process, so they
need a real server. SQLite is fine on one machine; Postgres for deployments.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

from kiln.core.errors import BadInput
from kiln.core.machine.home import kiln_home


def prefect_environment(*, quiet: bool) -> None:
    """Prefect's settings for a Kiln command, set in os.environ before Prefect is imported.

    What the user set wins (setdefault). The embedded API gets longer than its
    20 s to start on a busy small machine. The server sends no telemetry: Kiln
    often runs without internet, and on a fresh SQLite database the telemetry
    service's session record (a read, then a write, in one deferred
    transaction) fails at once with "database is locked" when another
    connection wrote in between; SQLite's busy timeout does not apply to that
    case, so the service is not started rather than given a longer timeout.
    `quiet`: Prefect's console shows warnings and errors only; flow and task
    run logs still reach the API (the UI) at INFO.
    """
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "120")
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    if quiet:
        os.environ.setdefault("PREFECT_LOGGING_HANDLERS_CONSOLE_LEVEL", "WARNING")


def check_server(url: str, timeout_s: float = 5.0) -> None:
    """BadInput unless the Prefect API at `url` answers its health check."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/health", timeout=timeout_s) as resp:
            if resp.status == 200:
                return
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise BadInput(f"cannot reach the Prefect server at PREFECT_API_URL={url} ({exc}); "
                       "start it (`prefect server start`) or unset PREFECT_API_URL.") from None
    raise BadInput(f"the Prefect server at {url} is not healthy; check its logs.")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def drain_logs() -> None:
    """Send Prefect's queued logs and events while the server is still up (else they fail after it stops)."""
    if "prefect" in sys.modules:
        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker
        for worker in (APILogWorker, EventsWorker):
            try:
                worker.drain_all(timeout=10)
            except Exception:  # best effort: the export itself is done
                pass


def server_log_path() -> Path:
    """KILN_HOME/logs/prefect-server.log: where the Prefect servers Kiln starts log (appended to)."""
    return kiln_home() / "logs" / "prefect-server.log"


def start_logged(cmd: list[str], env: dict, log_path: Path, pass_fds: tuple[int, ...] = ()) -> subprocess.Popen:
    """Start `cmd` in its own process session with stdout and stderr appended to `log_path` (and the open
    file descriptors `pass_fds`).

    A file, not a pipe: a pipe that nobody reads fills after 64 KiB and then
    blocks the process on its next log line.
    """
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"--- {time.strftime('%Y-%m-%dT%H:%M:%S%z')} {' '.join(cmd)}\n".encode())
        log.flush()
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                pass_fds=pass_fds)


def log_tail(log_path: Path, num_bytes: int = 2000) -> str:
    try:
        with open(log_path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - num_bytes))
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def wait_answering(proc: subprocess.Popen, url: str, log_path: Path, timeout_s: float, poll_s: float) -> None:
    """Return once the Prefect API at `url`, served by `proc`, answers its health check; RuntimeError (naming
    the log, with its end if the process exited) when `proc` exits or `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"the Prefect server exited with code {proc.returncode} (log: {log_path}): "
                               f"{log_tail(log_path)}")
        try:
            check_server(url, timeout_s=1.0)
            return
        except BadInput:
            if time.monotonic() > deadline:
                raise RuntimeError(f"the Prefect server did not answer within {timeout_s:.0f} s; its log: "
                                   f"{log_path}") from None
            time.sleep(poll_s)


class PrefectServer:
    """`prefect server start` on loopback in its own process session; `url` is its API address.

    Its output goes to `log_path` (default `server_log_path()`).
    """

    def __init__(self, home: Path | None = None, start_timeout_s: float = 120.0, ui: bool = False,
                 log_path: Path | None = None):
        port = _free_port()
        self.url = f"http://127.0.0.1:{port}/api"
        self.log_path = log_path or server_log_path()
        env = dict(os.environ, PREFECT_SERVER_ANALYTICS_ENABLED="false", PREFECT_UI_ENABLED=str(ui).lower())
        env.pop("PREFECT_API_URL", None)
        if home is not None:
            env["PREFECT_HOME"] = str(home)
        prefect = Path(sys.executable).with_name("prefect")
        self.proc = start_logged([str(prefect), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                                 env, self.log_path)
        try:
            wait_answering(self.proc, self.url, self.log_path, start_timeout_s, poll_s=0.5)
        except RuntimeError:
            if self.proc.poll() is None:
                self.stop()
            raise

    def stop(self) -> None:
        stop_process(self.proc, grace_s=20)


def stop_process(proc: subprocess.Popen, grace_s: float) -> None:
    """Terminate `proc`; kill it if it has not exited after `grace_s`."""
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@contextmanager
def local_server(home: Path | None = None):
    """Start a loopback Prefect server, point PREFECT_API_URL at it for this process, stop it after."""
    server = PrefectServer(home)
    old = os.environ.get("PREFECT_API_URL")
    os.environ["PREFECT_API_URL"] = server.url
    try:
        yield server.url
    finally:
        drain_logs()
        if old is None:
            os.environ.pop("PREFECT_API_URL", None)
        else:
            os.environ["PREFECT_API_URL"] = old
        server.stop()
