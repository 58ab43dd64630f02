"""Fault 3: the S3 connection misbehaves (latency, resets, truncated requests and responses).

A fault-injecting TCP proxy (tests/s3_fault_proxy.py, loopback only, a bounded number
of faults) sits between Kiln and the S3 server process, moto_server and
SeaweedFS in turn. Retries must carry every transfer through, and no truncated
or partial object may ever be accepted: checked afterwards directly against the
server, byte for byte. SeaweedFS also checks the transport checksums that moto
accepts unchecked, so a truncated request it receives is refused there too.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from urllib.parse import urlparse

import boto3
import pytest
from s3_fault_proxy import FaultProxy

from kiln.store.s3 import S3Store

# Every test against each real S3 server, each started once per session (tests/conftest.py).
pytestmark = pytest.mark.slow
MIB = 2**20


def direct(s3_server):
    return boto3.client("s3", endpoint_url=s3_server.endpoint_url)


def objects_are_whole(s3_server, bucket: str) -> dict[str, str]:
    """key -> sha256 of every object, read without the proxy; each must match its recorded sha256."""
    client, out = direct(s3_server), {}
    for obj in client.list_objects_v2(Bucket=bucket).get("Contents", []):
        resp = client.get_object(Bucket=bucket, Key=obj["Key"])
        body = resp["Body"].read()
        digest = hashlib.sha256(body).hexdigest()
        assert resp["Metadata"].get("sha256") == digest, f"{obj['Key']}: bytes do not match their sha256"
        assert len(body) == obj["Size"]
        out[obj["Key"]] = digest
    return out


@pytest.fixture
def bucket(s3_server, aws_test_env) -> str:
    name = f"kiln-faults-{uuid.uuid4().hex[:10]}"
    direct(s3_server).create_bucket(Bucket=name)
    return name


@pytest.mark.parametrize("s3_server", ["moto", "seaweedfs"], indirect=True)
def test_store_transfers_survive_a_misbehaving_connection(s3_server, bucket, small_forward, tmp_path,
                                                          record_property):
    src = tmp_path / "src"
    src.mkdir()
    files = {"forwards/real.pt2": Path(small_forward["path"]).read_bytes(),
             "tuning/gemm.json": json.dumps({"shape": [64, 128], "winner": "mkl"}).encode(),
             "forwards/big.pt2": os.urandom(12 * MIB)}  # multipart: 8 + 4 MiB parts
    files.update({f"forwards/{i}.pt2": os.urandom(1_700_000 + i) for i in range(3)})
    sha = {k: hashlib.sha256(v).hexdigest() for k, v in files.items()}
    for k, v in files.items():
        (src / k.replace("/", "_")).write_bytes(v)
    port = urlparse(s3_server.endpoint_url).port
    with FaultProxy(port, seed=7) as proxy:
        store = S3Store(bucket, "faults", endpoint_url=proxy.endpoint_url)
        proxy.arm(max_faults=12, cycle=("truncate_request", "reset_after", "slow", "reset_before", "truncate"))
        for k in files:
            store.put_file(k, src / k.replace("/", "_"), sha[k])  # True, or False when a lost answer was retried
        uploads = dict(proxy.fired)
        # A fresh client, as on another host: faults come per new connection, and a server that keeps
        # connections alive (SeaweedFS) would otherwise serve the downloads on the uploads' pool.
        store = S3Store(bucket, "faults", endpoint_url=proxy.endpoint_url)
        proxy.arm(max_faults=16, cycle=("truncate", "reset_before", "truncate", "slow", "reset_after", "truncate"))
        dest = tmp_path / "dest"
        for k in files:
            store.get_file(k, dest / k, sha[k])
            assert (dest / k).read_bytes() == files[k]
        assert store.get_bytes("tuning/gemm.json") == files["tuning/gemm.json"]
        assert sorted(store.list()) == sorted(files)
        assert all(store.stat(k).sha256 == sha[k] and store.stat(k).size_bytes == len(files[k]) for k in files)
        downloads = {m: proxy.fired[m] - uploads.get(m, 0) for m in proxy.fired}
    record_property("faults_fired", dict(proxy.fired))
    print(f"faults fired: uploads {uploads}, downloads {downloads}")
    # The faults really happened, in both directions.
    assert uploads.get("truncate_request", 0) >= 1 and uploads.get("reset_after", 0) >= 1, uploads
    assert downloads.get("truncate", 0) >= 2 and downloads.get("reset_before", 0) >= 1, downloads
    # Nothing partial anywhere: the server holds exactly the objects, whole; no download left a temp file.
    assert objects_are_whole(s3_server, bucket) == {f"faults/{k}": v for k, v in sha.items()}
    assert not [p for p in dest.rglob("*") if p.name.endswith(".part")]
    assert direct(s3_server).list_multipart_uploads(Bucket=bucket).get("Uploads", []) == []


# The whole export under faults on moto only: the store's transfers (above) are what meets the server,
# and they are tested on both; a second export here would cost minutes of compiling for nothing more.
@pytest.mark.parametrize("s3_server", ["moto"], indirect=True)
def test_export_and_verify_through_a_misbehaving_connection(kiln, s3_server, bucket, signing_key_env, tmp_path,
                                                            record_property):
    aws = {k: os.environ[k] for k in os.environ if k.startswith("AWS_")}
    env = {**aws, **signing_key_env}
    report = tmp_path / "r.json"
    store = f"s3://{bucket}/exports"
    with FaultProxy(urlparse(s3_server.endpoint_url).port, seed=11) as proxy:
        # The two store checks before any work (CLI, then flow) are meant to fail fast on a dead
        # endpoint; the faults start after them, in the middle of the export.
        proxy.arm(max_faults=20, pass_first=2)
        run = kiln("export", "--tp", "2", "--buckets", "1x8", "--store", store, "--s3-endpoint",
                   proxy.endpoint_url, "--report", str(report), env=env)
        during_export = sum(proxy.fired.values())
        proxy.arm(max_faults=10, pass_first=1, cycle=("truncate", "reset_before", "truncate", "slow"))
        r = json.loads(report.read_text()) if report.exists() else {}
        v = kiln("verify", "--store", store, "--s3-endpoint", proxy.endpoint_url, r.get("export_id", "none"),
                 env=env)
        during_verify = sum(proxy.fired.values()) - during_export
    record_property("faults_fired", dict(proxy.fired))
    print(f"faults fired: export {during_export}, verify {during_verify}: {dict(proxy.fired)}")
    assert run.code == 0, run.err[-3000:]
    assert v.code == 0, v.err[-3000:]
    assert "signature ok" in v.out and "verify ok" in v.out
    assert during_export >= 3 and during_verify >= 1, (during_export, during_verify, proxy.fired)
    stored = objects_are_whole(s3_server, bucket)
    [fwd] = r["forwards"]
    assert stored[f"exports/{fwd['object']}"] == fwd["sha256"]
    assert f"exports/{r['manifest']}" in stored and f"exports/{r['signing']['signature']}" in stored
