"""Operations tests: a real Prefect server on loopback, `kiln serve` and `kiln export` as users run them.

The server is started once for tests/ops/ with its own PREFECT_HOME in a temp
dir and, as infra/compose.yaml runs it, its database in PostgreSQL: a cluster
started on loopback (tests/pg_cluster.py). Both are package fixtures (tests/ops/
is a package for that): stopped after the last test here, not at the end of the
session, since an idle Prefect server still costs about 2 % of a core (its
services poll) for the rest of the run. A test can ask for the single-machine
default, SQLite, with
`@pytest.mark.parametrize("prefect_server", ["sqlite"], indirect=True)`: the
session's own SQLite server (tests/conftest.py), which the suite's exports
report to as well, not a second one. Each test gets its own KILN_HOME and its
own deployment names, so tests do not see each other's stores or runs.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

BIN = Path(sys.executable).parent
REPO = Path(__file__).resolve().parents[2]
_SERVER_START_TIMEOUT_S = 180.0  # the first start migrates the database; slow on a busy 2-core machine


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class PrefectServer:
    url: str
    """The UI's address, e.g. http://127.0.0.1:PORT."""
    process: subprocess.Popen | None
    """None for a server this package did not start (the session's SQLite one)."""
    log: Path | None

    @property
    def api_url(self) -> str:
        return f"{self.url}/api"

    def api(self) -> "Api":
        return Api(self.api_url)


# Prefect's own client retries 429, 502 and 503 (a briefly busy database) after a backoff; so do the tests.
_RETRY_STATUS = (429, 502, 503)
_RETRY_DELAYS_S = (0.5, 1.0, 2.0, 4.0, 8.0)


class Api:
    """The few Prefect REST calls the tests read their results through."""

    def __init__(self, api_url: str):
        self.http = httpx.Client(base_url=api_url, timeout=30)

    def _send(self, method: str, path: str, **kwargs) -> httpx.Response:
        for delay in _RETRY_DELAYS_S:
            r = self.http.request(method, path, **kwargs)
            if r.status_code not in _RETRY_STATUS:
                return r
            time.sleep(delay)
        return self.http.request(method, path, **kwargs)

    def get(self, path: str) -> dict | list:
        r = self._send("GET", path)
        r.raise_for_status()
        return r.json()

    def post(self, path: str, body: dict | None = None) -> httpx.Response:
        return self._send("POST", path, json=body or {})

    def deployment(self, flow: str, name: str) -> dict | None:
        r = self._send("GET", f"/deployments/name/{flow}/{name}")
        return r.json() if r.status_code == 200 else None

    def flow_run(self, flow_run_id: str) -> dict:
        return self.get(f"/flow_runs/{flow_run_id}")

    def flow_runs(self, **flow_run_filter) -> list[dict]:
        r = self.post("/flow_runs/filter", {"flow_runs": flow_run_filter, "limit": 200, "sort": "START_TIME_ASC"})
        r.raise_for_status()
        return r.json()

    def runs_of_export(self, export_id: str) -> list[dict]:
        """Flow runs whose parameters name `export_id` (the CLI sets it; Prefect cannot filter on parameters)."""
        return [r for r in self.flow_runs() if r["parameters"].get("export_id") == export_id]

    def task_runs(self, flow_run_id: str) -> list[dict]:
        r = self.post("/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}, "limit": 200,
                                            "sort": "EXPECTED_START_TIME_ASC"})
        r.raise_for_status()
        return r.json()

    def artifacts(self, flow_run_id: str) -> list[dict]:
        r = self.post("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}, "limit": 100})
        r.raise_for_status()
        return r.json()

    def states(self, flow_run_id: str) -> list[dict]:
        r = self._send("GET", "/flow_run_states/", params={"flow_run_id": flow_run_id})
        r.raise_for_status()
        return r.json()

    def logs(self, flow_run_id: str) -> str:
        r = self.post("/logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "limit": 200,
                                       "sort": "TIMESTAMP_ASC"})
        r.raise_for_status()
        return "\n".join(entry["message"] for entry in r.json())

    def logs_with(self, flow_run_id: str, text: str, timeout_s: float = 30.0) -> str:
        """The run's logs once they hold `text`, or as they are after `timeout_s`: the run's process ships its
        logs in batches, so a run can be seen final before its last lines reach the server (seen under load)."""
        deadline = time.monotonic() + timeout_s
        while text not in (logs := self.logs(flow_run_id)) and time.monotonic() < deadline:
            time.sleep(1.0)
        return logs

    def wait_final(self, flow_run_id: str, timeout_s: float) -> dict:
        """Poll until the flow run is in a final state; fail the test after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            run = self.flow_run(flow_run_id)
            if run["state_type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
                return run
            if time.monotonic() > deadline:
                pytest.fail(f"flow run {flow_run_id} still {run['state_type']} ({run['state_name']}) "
                            f"after {timeout_s} s")
            time.sleep(1.0)


def _stop_group(proc: subprocess.Popen, first: int = signal.SIGTERM, grace_s: float = 20.0) -> None:
    """Stop a process this suite started in its own session, and everything it started."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, first)
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass


@pytest.fixture(scope="package")
def postgres():
    """A PostgreSQL cluster for the session (tests/pg_cluster.py); yields its pg_cluster.Cluster."""
    import importlib.util

    import pg_cluster

    if (bin_dir := pg_cluster.find_bin_dir()) is None:
        pytest.skip("PostgreSQL's initdb, pg_ctl and psql are neither on PATH nor under /usr/lib/postgresql/*/bin; "
                    "`make test-setup` installs Debian's postgresql")
    if importlib.util.find_spec("asyncpg") is None:
        pytest.skip("asyncpg is not installed (pip install -e '.[test]')")
    try:
        cluster = pg_cluster.start(bin_dir, free_port())
    except RuntimeError as e:
        pytest.fail(str(e))
    yield cluster
    pg_cluster.stop(cluster)


@pytest.fixture(scope="package")
def postgres_prefect_server(postgres, tmp_path_factory) -> Iterator[PrefectServer]:
    """Prefect's server on the session's PostgreSQL, as infra/compose.yaml runs it (checked: its tables are there)."""
    import pg_cluster

    servers = _prefect_server(tmp_path_factory.mktemp("prefect-server-pg"),
                              {"PREFECT_API_DATABASE_CONNECTION_URL": postgres.url})
    server = next(servers)
    tables = pg_cluster.query(postgres, "SELECT tablename FROM pg_tables WHERE schemaname = 'public'").split()
    if "flow_run" not in tables:
        servers.close()
        pytest.fail(f"prefect server at {server.url} answers but made no tables in PostgreSQL ({tables}); "
                    f"log: {server.log.read_text()[-3000:]}")
    yield server
    servers.close()


@pytest.fixture(scope="package")
def sqlite_prefect_server(session_prefect_url) -> PrefectServer:
    """Prefect's server on SQLite, the single-machine default: the session's (tests/conftest.py), already
    running on this worker or started here and used by the suite's exports after (a start and an idle
    server less). It runs `prefect server start` on its own PREFECT_HOME, as `_prefect_server` does."""
    return PrefectServer(session_prefect_url().removesuffix("/api"), process=None, log=None)


@pytest.fixture(scope="package")
def prefect_server(request) -> PrefectServer:
    """The session's Prefect server on PostgreSQL, or on SQLite for a test that parametrises it with "sqlite"."""
    database = getattr(request, "param", "postgres")
    if database not in ("postgres", "sqlite"):
        raise ValueError(f"unknown Prefect database {database!r}; use 'postgres' or 'sqlite'")
    return request.getfixturevalue(f"{database}_prefect_server")


def _prefect_server(root: Path, db_env: dict[str, str]) -> Iterator[PrefectServer]:
    """`prefect server start` on a free loopback port with its own PREFECT_HOME under `root` (SQLite there
    unless `db_env` names another database); stopped when the generator is closed."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(root / "home"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_UI_API_URL=f"{url}/api", PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT="false", **db_env)
    log = root / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    server = PrefectServer(url, proc, log)
    deadline = time.monotonic() + _SERVER_START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"prefect server exited with {proc.returncode}: {log.read_text()[-3000:]}")
        try:
            if httpx.get(f"{url}/api/health", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            _stop_group(proc)
            pytest.fail(f"prefect server did not answer at {url} within {_SERVER_START_TIMEOUT_S} s: "
                        f"{log.read_text()[-3000:]}")
        time.sleep(0.5)
    try:
        yield server
    finally:  # also when the caller closes the generator (GeneratorExit at the yield)
        _stop_group(proc)


@pytest.fixture
def ops_env(prefect_server, tmp_path) -> dict:
    """Environment of a user of that server: own KILN_HOME and Prefect client home; runs start from tmp_path."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "KILN_"))}
    env.update(PREFECT_API_URL=prefect_server.api_url, PREFECT_HOME=str(tmp_path / "prefect-client"),
               KILN_HOME=str(tmp_path / "kiln-home"), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_RUNNER_POLL_FREQUENCY="2", PYTHONUNBUFFERED="1")
    return env


@dataclass
class Served:
    name: str
    deployment: dict
    process: subprocess.Popen
    log: Path


@pytest.fixture
def serve(prefect_server, ops_env, tmp_path) -> Iterator[Callable[..., Served]]:
    """`serve(*flags)` runs `kiln serve --name <unique> *flags` and waits for its deployment."""
    started: list[Served] = []
    api = prefect_server.api()

    def start(*flags: str, timeout_s: float = 180.0) -> Served:
        name = f"test-{uuid.uuid4().hex[:8]}"
        log = tmp_path / f"serve-{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "cli.main", "serve", "--name", name, *flags],
                                    stdout=out, stderr=subprocess.STDOUT, env=ops_env, cwd=tmp_path,
                                    start_new_session=True)
        served = Served(name, {}, proc, log)
        started.append(served)
        deadline = time.monotonic() + timeout_s
        while not (dep := api.deployment("kiln-export", name)):
            if proc.poll() is not None:
                pytest.fail(f"kiln serve exited with {proc.returncode}: {log.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                pytest.fail(f"kiln serve made no deployment within {timeout_s} s: {log.read_text()[-3000:]}")
            time.sleep(1.0)
        served.deployment = dep
        return served

    yield start
    for served in started:
        # SIGTERM: Prefect's runner pauses the deployment and exits (1-3 s). A SIGINT was not acted on in full
        # `make test` runs (every teardown took the 20 s grace, then SIGKILL: 2 min of the suite).
        _stop_group(served.process, signal.SIGTERM)


@pytest.fixture
def kiln_run(ops_env, tmp_path) -> Callable[..., subprocess.CompletedProcess]:
    """`kiln_run(*args, env={...})`: the kiln CLI against the test server, from tmp_path."""
    def run(*args: str, env: dict | None = None, timeout: float = 900) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "cli.main", *args], env={**ops_env, **(env or {})},
                              cwd=tmp_path, capture_output=True, text=True, timeout=timeout)
    return run


@pytest.fixture
def keep_dir() -> Path:
    """Where tests copy what a person should look at (screenshots): .kiln/test-artifacts in the repo."""
    path = REPO / ".kiln" / "test-artifacts"
    path.mkdir(parents=True, exist_ok=True)
    return path
