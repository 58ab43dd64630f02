"""`--model s3://BUCKET/PREFIX`: a checkpoint exported where it is, at tp 2 on two local hosts, with no local
copy, against a real S3 API (moto_server on loopback).

One compile (1 bucket): the directory export compiles it, the S3 export of the same checkpoint finds the
same keys in the store, and each host reads and caches only its own rank's slices.
"""

from __future__ import annotations

import json
import os

import boto3
import pytest

from kiln.core.model.config import TINY
from kiln.host.weights.checkpoint import random_checkpoint

pytestmark = pytest.mark.slow


def test_an_s3_checkpoint_exports_like_its_directory_and_verify_checks_its_identity(kiln, s3_bucket, s3_server,
                                                                                     tmp_path):
    folder = random_checkpoint(tmp_path / "s3ckpt", TINY.replace(num_layers=1), seed=5, num_shards=2)
    bucket = s3_bucket[5:].split("/")[0]
    client = boto3.client("s3", endpoint_url=s3_server.endpoint_url)
    for f in sorted(folder.iterdir()):
        client.upload_file(str(f), bucket, f"ckpt/s3ckpt/{f.name}")
    url = f"s3://{bucket}/ckpt/s3ckpt"
    aws = {k: os.environ[k] for k in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                                      "AWS_DEFAULT_REGION", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE")}
    home = tmp_path / "home"
    env = {**aws, "KILN_HOME": str(home)}
    store = f"file://{tmp_path / 'store'}"
    common = ["--tp", "2", "--buckets", "1x8", "--store", store]

    bad = kiln("plan", "--model", f"s3://{bucket}/ckpt/absent", *common, env=env, timeout=120)
    assert bad.code == 2 and f"s3://{bucket}/ckpt/absent/config.json does not exist" in bad.err, bad.err

    from_dir = kiln("export", "--model", str(folder), *common, "--export-id", "from-dir",
                    "--report", str(tmp_path / "dir.json"), env=env)
    assert from_dir.code == 0, from_dir.err[-3000:]
    # Without PREFECT_API_URL, as a user runs it: `--hosts 2` starts a Prefect server of its own (the one test
    # of that path).
    from_s3 = kiln("export", "--model", url, *common, "--hosts", "2", "--export-id", "from-s3",
                   "--report", str(tmp_path / "s3.json"), env=env, embedded=True)
    assert from_s3.code == 0, from_s3.err[-3000:]
    dir_report, s3_report = (json.loads((tmp_path / f"{n}.json").read_text()) for n in ("dir", "s3"))
    assert [f["key"] for f in s3_report["forwards"]] == [f["key"] for f in dir_report["forwards"]]
    assert s3_report["counts"]["compiled"] == 0 and s3_report["counts"]["reused"] == 1
    assert all(c["diff"] <= c["limit"] for checks in s3_report["verify"].values() for c in checks.values())

    # Each host read only its rank's slices, into its own cache (the weightless compile needed none).
    for host, rank in (("host-0", 0), ("host-1", 1)):
        cached = sorted(p.name for p in (home / "cache" / host / "s3-checkpoints").glob("*/*.safetensors"))
        assert cached == [f"rank{rank}-of-2.safetensors"], (host, cached)

    manifest = json.loads((tmp_path / "store" / "exports" / "from-s3" / "manifest.json").read_text())
    identity = manifest["model"]["checkpoint_identity"]
    listed = {o["Key"].rsplit("/", 1)[-1]: (o["Size"], o["ETag"].strip('"'))
              for o in client.list_objects_v2(Bucket=bucket, Prefix="ckpt/s3ckpt/")["Contents"]}
    assert {o["name"]: (o["size_bytes"], o["etag"]) for o in identity["objects"]} == listed
    assert manifest["model"]["checkpoint"] == url

    ok = kiln("verify", "from-s3", "--store", store, env=env, timeout=900)
    assert ok.code == 0 and "verify ok" in ok.out, ok.err[-3000:]
    client.put_object(Bucket=bucket, Key="ckpt/s3ckpt/config.json", Body=(folder / "config.json").read_bytes() + b" ")
    changed = kiln("verify", "from-s3", "--store", store, env=env, timeout=300)
    assert changed.code == 2 and "config.json was" in changed.err and "is not the one exported" in changed.err, \
        changed.err
