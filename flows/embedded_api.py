"""Prefect's embedded API for one `kiln export`, started first thing so that its start-up overlaps Kiln's.

Without a Prefect server (no PREFECT_API_URL) Prefect starts its embedded
("ephemeral") API on the first client call: a uvicorn process serving
`prefect.server.api.server:create_app` with `PREFECT__SERVER_EPHEMERAL`, on the
SQLite database of PREFECT_HOME. The caller imports the whole server stack to
start it (FastAPI, SQLAlchemy, docket: seconds of CPU it never uses) and then
waits for the server's own imports, after its own are done. Here `kiln export`
starts that same process, with the same command and settings, before it
imports torch or Prefect, and points PREFECT_API_URL at it: the two start in
parallel, and the export process never imports the server. Its flow run,
task runs, logs, events, artifacts and the model's concurrency limit are
Prefect's as before, on the same database; the server's lease storage is in
its memory and ends with it, as the embedded API's did (kiln.flows.model_lease
asks `is_embedded`). Its output goes to `server_log_path()`.

Not started where Prefect's API is configured some other way (PREFECT_API_URL,
a profile, a prefect.toml or .env naming an API, ephemeral mode disallowed):
Prefect then does what it is configured to do.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

from flows.prefect_server import drain_logs, server_log_path, start_logged, stop_process, wait_answering

EMBEDDED_API_ENV = "KILN_EMBEDDED_API_URL"
"""Set to the API's URL while Kiln's embedded API serves this process (and the processes it starts)."""

_SERVER_ENV = {"PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1", "PREFECT__SERVER_FINAL": "1"}
"""What Prefect's SubprocessASGIServer sets for its embedded server (prefect 3.x)."""


def is_embedded(api_url: str | None) -> bool:
    """Whether `api_url` (Prefect's API setting now) is an embedded API: none set, or Kiln's own."""
    return not api_url or os.environ.get(EMBEDDED_API_ENV) == api_url


def configured_elsewhere(cwd: Path | None = None) -> bool:
    """Whether Prefect may take its API from somewhere other than the environment (then Kiln starts none):
    PREFECT_API_URL set, ephemeral mode disallowed, or an API URL in the active profile, ./prefect.toml,
    ./pyproject.toml's [tool.prefect] or ./.env; an unreadable one counts as configured."""
    if os.environ.get("PREFECT_API_URL") or _false(os.environ.get("PREFECT_SERVER_ALLOW_EPHEMERAL_MODE")):
        return True
    cwd = cwd or Path.cwd()
    home = Path(os.environ.get("PREFECT_HOME") or Path.home() / ".prefect").expanduser()
    try:
        profiles = _toml(Path(os.environ.get("PREFECT_PROFILES_PATH") or home / "profiles.toml"))
        active = profiles.get("profiles", {}).get(os.environ.get("PREFECT_PROFILE") or profiles.get("active", "ephemeral"), {})
        if active.get("PREFECT_API_URL") or _false(active.get("PREFECT_SERVER_ALLOW_EPHEMERAL_MODE")):
            return True
        for table in (_toml(cwd / "prefect.toml"), _toml(cwd / "pyproject.toml").get("tool", {}).get("prefect", {})):
            if table.get("api", {}).get("url") or table.get("PREFECT_API_URL"):
                return True
        dotenv = cwd / ".env"
        if dotenv.exists() and "PREFECT_API_URL" in dotenv.read_text(errors="replace"):
            return True
    except (OSError, ValueError, AttributeError):
        return True
    return False


def _false(value) -> bool:
    return str(value).strip().lower() in ("0", "false", "no", "off")


def _toml(path: Path) -> dict:
    import tomllib

    if not path.exists():
        return {}
    with open(path, "rb") as f:
        return tomllib.load(f)


class EmbeddedAPI:
    """The embedded API's server process, listening on a socket bound here (no port race).

    `url` is set in os.environ as PREFECT_API_URL (and EMBEDDED_API_ENV) from construction on; nothing may
    talk to it before `wait_ready()`.
    """

    def __init__(self, log_path: Path | None = None):
        self.log_path = log_path or server_log_path()
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}/api"
        app_dir = Path(importlib.util.find_spec("prefect").origin).parent.parent  # what Prefect passes
        env = {**os.environ, **_SERVER_ENV}
        env.pop("PREFECT_API_URL", None)
        cmd = [sys.executable, "-m", "uvicorn", "--app-dir", str(app_dir), "--factory",
               "prefect.server.api.server:create_app", "--fd", str(self._sock.fileno()), "--log-level", "error",
               "--lifespan", "on"]
        self.proc = start_logged(cmd, env, self.log_path, pass_fds=(self._sock.fileno(),))
        os.environ["PREFECT_API_URL"] = os.environ[EMBEDDED_API_ENV] = self.url

    def wait_ready(self) -> None:
        """Return once the API answers its health check; RuntimeError if it exits or does not answer within
        PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS (as Prefect's own start)."""
        timeout_s = float(os.environ.get("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "20"))
        wait_answering(self.proc, self.url, self.log_path, timeout_s, poll_s=0.05)

    def stop(self) -> None:
        """Send what Prefect still queues for it, then stop the server (terminate; kill after 5 s)."""
        drain_logs()
        for name in ("PREFECT_API_URL", EMBEDDED_API_ENV):
            if os.environ.get(name) == self.url:
                del os.environ[name]
        stop_process(self.proc, grace_s=5)
        self._sock.close()


@contextmanager
def embedded_api(start: bool) -> Iterator[EmbeddedAPI | None]:
    """Kiln's embedded API for this command when `start` and Prefect's API is not configured elsewhere;
    else None (Prefect does what it is configured to do). Stopped on exit."""
    api = EmbeddedAPI() if start and not configured_elsewhere() else None
    try:
        yield api
    finally:
        if api is not None:
            api.stop()
