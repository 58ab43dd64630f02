"""An existing Dask cluster (`--dask ADDRESS`): one worker per host, named by its resource."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
DASK = str(Path(sys.executable).with_name("dask"))


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def dask_cluster(kiln_env, prefect_server, s3_server, tmp_path_factory):
    """`dask scheduler` and two `dask worker`s (host-a, host-b) on loopback, as a user would start them.

    Each host has its own S3 credentials in its environment, as on a real cluster.
    """
    log = tmp_path_factory.mktemp("dask")
    port = _port()
    address = f"tcp://127.0.0.1:{port}"
    env = {**kiln_env, "PREFECT_API_URL": prefect_server, "DASK_DISTRIBUTED__WORKER__DAEMON": "False",
           "AWS_ENDPOINT_URL": s3_server.endpoint_url, "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    procs = [subprocess.Popen([DASK, "scheduler", "--host", "127.0.0.1", "--port", str(port), "--no-dashboard"],
                              env=env, stdout=open(log / "scheduler.log", "wb"), stderr=subprocess.STDOUT)]
    for name in ("host-a", "host-b"):
        procs.append(subprocess.Popen(
            [DASK, "worker", address, "--host", "127.0.0.1", "--nworkers", "1", "--nthreads", "2", "--name", name,
             "--resources", f"kiln-host-{name}=1", "--no-dashboard"],
            env=env, stdout=open(log / f"{name}.log", "wb"), stderr=subprocess.STDOUT))
    from distributed import Client
    deadline = time.monotonic() + 120
    with Client(address, timeout=60) as client:
        while len(client.scheduler_info()["workers"]) < 2:
            assert time.monotonic() < deadline, "dask workers did not join"
            time.sleep(0.5)
    yield address
    for p in reversed(procs):
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=20)
        except subprocess.TimeoutExpired:
            p.kill()


def test_export_on_an_existing_cluster(kiln, dask_cluster, prefect_server, s3_bucket, signing_key_env, tmp_path):
    aws = {k: os.environ[k] for k in os.environ if k.startswith("AWS_")}
    report = tmp_path / "r.json"
    run = kiln("export", "--dask", dask_cluster, "--tp", "2", "--buckets", "1x8,2x8", "--store", s3_bucket,
               "--report", str(report), env={**aws, **signing_key_env, "PREFECT_API_URL": prefect_server})
    assert run.code == 0, run.err[-3000:]
    r = json.loads(report.read_text())
    assert {h["name"]: h["ranks"] for h in r["hosts"]} == {"host-a": [0], "host-b": [1]}
    assert r["counts"]["compiled"] == 2
    assert {f["compiled_by"] for f in r["forwards"]} <= {"host-a", "host-b"}
    assert all(len(h["memory"]) == 9 for h in r["hosts"])


def test_unreachable_scheduler_is_bad_input(kiln, prefect_server):
    run = kiln("export", "--dask", f"tcp://127.0.0.1:{_port()}", "--tp", "2",
               env={"PREFECT_API_URL": prefect_server})
    assert run.code == 2, run.err[-2000:]
    assert "cannot reach the Dask scheduler" in run.err and "Traceback" not in run.err


def test_dask_without_prefect_server_is_bad_input(kiln):
    run = kiln("export", "--dask", "tcp://127.0.0.1:1", "--tp", "2")
    assert run.code == 2 and "PREFECT_API_URL" in run.err


def test_unreachable_prefect_server_is_bad_input(kiln):
    run = kiln("export", "--tp", "2", env={"PREFECT_API_URL": f"http://127.0.0.1:{_port()}/api"})
    assert run.code == 2 and "cannot reach the Prefect server" in run.err
