"""An existing Dask cluster (`--dask ADDRESS`): one worker per host, named by its resource."""

from __future__ import annotations

import json
import os

import pytest
from conftest import DaskCluster, cluster_env, free_port

pytestmark = pytest.mark.slow
@pytest.fixture(scope="module")
def dask_cluster(kiln_env, prefect_server, s3_server, signing_key_env, tmp_path_factory):
    """Two hosts (host-a, host-b), each with its own S3 credentials in its environment, as on a real cluster."""
    cluster = DaskCluster(cluster_env(kiln_env, prefect_server, s3_server.endpoint_url, signing_key_env),
                          {"host-a": {}, "host-b": {}}, tmp_path_factory.mktemp("dask"))
    yield cluster.address
    cluster.stop()


def test_export_on_an_existing_cluster(kiln, dask_cluster, prefect_server, s3_bucket, signing_key_env, tmp_path):
    aws = {k: os.environ[k] for k in os.environ if k.startswith("AWS_")}
    report = tmp_path / "r.json"
    # One forward: one host compiles it and the other downloads it from the store with its own credentials;
    # that the gate spreads forwards over every host is test_incident.py's (three hosts, three forwards).
    run = kiln("export", "--dask", dask_cluster, "--tp", "2", "--buckets", "1x8", "--store", s3_bucket,
               "--report", str(report), env={**aws, **signing_key_env, "PREFECT_API_URL": prefect_server})
    assert run.code == 0, run.err[-3000:]
    r = json.loads(report.read_text())
    assert {h["name"]: h["ranks"] for h in r["hosts"]} == {"host-a": [0], "host-b": [1]}
    assert r["counts"]["compiled"] == 1
    [compiler] = {f["compiled_by"] for f in r["forwards"]}
    assert compiler in {"host-a", "host-b"}
    downloaded = {h["name"]: h.get("downloaded") for h in r["hosts"]}
    assert downloaded == {compiler: 0, ({"host-a", "host-b"} - {compiler}).pop(): 1}, downloaded
    # Every phase boundary on every host, and the lowest reading while compiling on each host that compiled.
    assert all(len([m for m in h["memory"] if m["phase"] != "compile (lowest)"]) == 9 for h in r["hosts"])
    compilers = {f["compiled_by"] for f in r["forwards"]}
    assert all(any(m["phase"] == "compile (lowest)" for m in h["memory"]) == (h["name"] in compilers)
               for h in r["hosts"])


def test_unreachable_scheduler_is_bad_input(kiln, prefect_server):
    run = kiln("export", "--dask", f"tcp://127.0.0.1:{free_port()}", "--tp", "2",
               env={"PREFECT_API_URL": prefect_server})
    assert run.code == 2, run.err[-2000:]
    assert "cannot reach the Dask scheduler" in run.err and "Traceback" not in run.err
