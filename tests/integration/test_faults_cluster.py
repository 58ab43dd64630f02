"""Faults of a multi-host export: a host lost mid-compile, two exports racing for the same keys."""

from __future__ import annotations

import hashlib
import json
import os
import uuid

import boto3
import pytest
from conftest import DaskCluster, cluster_env
from overlapping import run_overlapping
from procmarks import marked, wait_gone

pytestmark = pytest.mark.slow


def _objects(url: str) -> dict[str, bytes]:
    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    out = {}
    for o in s3.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/forwards/").get("Contents", []):
        out[o["Key"]] = s3.get_object(Bucket=bucket, Key=o["Key"])["Body"].read()
    return out


def test_host_lost_mid_compile_hands_its_keys_to_the_others(kiln, kiln_env, prefect_server, s3_server,
                                                            s3_bucket, signing_key_env, tmp_path):
    # host-b's worker (no nanny: nothing restarts it) kills itself right after its first upload.
    mark = uuid.uuid4().hex  # every process host-b's worker starts inherits it
    cluster = DaskCluster(cluster_env(kiln_env, prefect_server, s3_server.endpoint_url, signing_key_env),
                          {"host-a": {}, "host-b": {"KILN_FAULT_DIE_AFTER_UPLOADS": "1", "KILN_TEST_MARK": mark}},
                          tmp_path, nanny=False)
    try:
        report = tmp_path / "r.json"
        aws = {k: os.environ[k] for k in os.environ if k.startswith("AWS_")}
        # Leases that outlive the test: only breaking the lost host's leases lets the others go on.
        run = kiln("export", "--dask", cluster.address, "--tp", "2", "--buckets", "1x8,2x8,4x8,8x8", "--shape-policy", "static",
                   "--store", s3_bucket, "--report", str(report), "--set", "lease_ttl_s=7200",
                   env={**aws, **signing_key_env, "PREFECT_API_URL": prefect_server})
        assert cluster.workers["host-b"].poll() is not None, "the fault did not fire"
        # Its compile workers died with it (they would hold memory the next export's gate measures).
        assert not wait_gone(mark), f"left behind by the lost host: {marked(mark)}"
    finally:
        cluster.stop()
    assert run.code == 0, run.err[-3000:]
    r = json.loads(report.read_text())
    hosts = {h["name"]: h for h in r["hosts"]}
    assert hosts["host-b"].get("lost") is True
    by = [f["compiled_by"] for f in r["forwards"]]
    assert by.count("host-b") >= 1, "host-b's finished artifact must be kept, not recompiled"
    assert by.count("host-a") + by.count("host-b") == 4 and r["counts"]["compiled"] == 4
    compile_phase = next(p for p in r["phases"] if p["name"] == "compile")
    assert compile_phase["lost_hosts"] == ["host-b"]
    assert compile_phase["duration_s"] < 1200, "the others waited for the lost host's leases to expire"
    assert not _leases(s3_bucket), "a lease of the lost host was left behind"
    objects = _objects(s3_bucket)
    assert len(objects) == 4
    for f in r["forwards"]:  # nothing lost, nothing corrupt
        assert hashlib.sha256(objects[f"{s3_bucket.split('/', 3)[3]}/{f['object']}"]).hexdigest() == f["sha256"]


def _leases(url: str) -> list[str]:
    bucket, prefix = url.removeprefix("s3://").split("/", 1)
    s3 = boto3.client("s3", endpoint_url=os.environ["AWS_ENDPOINT_URL"])
    return [o["Key"] for o in s3.list_objects_v2(Bucket=bucket, Prefix=f"{prefix}/leases/").get("Contents", [])]


def test_two_exports_at_once_compile_each_key_once(kiln, s3_bucket, signing_key_env, tmp_path):
    """Two checkpoints of one architecture (the bundled tiny model, and tiny's shape with other weights)
    exported at once into one store: their model leases differ, their forward keys are the same (weights
    are in no key), and both finish. Each export talks to its own embedded Prefect API, so only the
    store's leases keep them apart.

    The second export starts once the first holds a compile lease, and the first's compiles wait (the
    fault seam's KILN_FAULT_HOLD_COMPILE) until the second has probed the store, so the two overlap
    however slowly the second starts on a loaded machine: the second must find keys leased, wait for them
    and reuse them, never compile them again. The leases' TTL (3 s) is far shorter than that wait: only
    the holder's renewals keep the second from taking over.
    """
    import time

    aws = {k: os.environ[k] for k in os.environ if k.startswith("AWS_")}
    other = tmp_path / "tiny-other-weights"
    assert kiln("checkpoint", str(other), "--seed", "7").code == 0
    models = ["tiny", str(other)]
    args = ["--tp", "2", "--buckets", "1x8,2x8", "--store", s3_bucket, "--set", "lease_ttl_s=3"]

    probed = str(tmp_path / "second-probed")
    overlap = [{"KILN_FAULT_HOLD_COMPILE": probed}, {"KILN_FAULT_MARK_PROBE": probed}]

    def one(i: int):
        env = {**aws, **signing_key_env, "PREFECT_HOME": str(tmp_path / f"prefect{i}"), **overlap[i]}
        return kiln("export", "--model", models[i], *args, "--report", str(tmp_path / f"r{i}.json"), env=env,
                    embedded=True)

    runs = run_overlapping(one, lambda: bool(_leases(s3_bucket)))  # the first holds a compile lease
    for run in runs:
        assert run.code == 0, run.err[-3000:]
        assert "took over the compile lease" not in run.err  # the holder renewed: no lease lapsed
    reports = [json.loads((tmp_path / f"r{i}.json").read_text()) for i in (0, 1)]
    compiled = [f["key"] for r in reports for f in r["forwards"] if f["compiled_by"]]
    assert sorted(compiled) == sorted(set(compiled)), "a key was compiled by both exports"
    assert len(set(compiled)) == 2
    assert sum(r["counts"]["compiled"] for r in reports) == 2
    waited = set(reports[1]["hosts"][0]["waited_for_lease"])
    assert waited, "the exports did not overlap: the second never waited for a lease"
    first_compiled = {f["key"] for f in reports[0]["forwards"] if f["compiled_by"]}
    assert waited <= first_compiled, "it waited for keys the first export did not compile"
    assert {f["sha256"] for f in reports[0]["forwards"]} == {f["sha256"] for f in reports[1]["forwards"]}
    assert len(_objects(s3_bucket)) == 2
    assert not _leases(s3_bucket), "a lease outlived its compile"
