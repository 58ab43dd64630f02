"""Prefect blocks configure an export: the store (S3 with prefect-aws credentials) and the recipe."""

from __future__ import annotations

import json
import uuid

import boto3
import pytest

pytestmark = pytest.mark.slow

SECRET = f"kiln-secret-{uuid.uuid4().hex}"


@pytest.fixture
def blocks(prefect_server, s3_server):
    """A store block (S3 through a proxy that records which access key signed each request) and a recipe block."""
    from prefect.settings import PREFECT_API_URL, temporary_settings
    from prefect_aws import AwsCredentials
    from s3_fault_proxy import FaultProxy

    from blocks.kiln_blocks import KilnRecipe, KilnStore

    port = int(s3_server.endpoint_url.rsplit(":", 1)[1])
    proxy = FaultProxy(port, max_faults=0).__enter__()

    bucket = f"kiln-blocks-{uuid.uuid4().hex[:8]}"
    boto3.client("s3", endpoint_url=s3_server.endpoint_url, aws_access_key_id="x", aws_secret_access_key="y",
                 region_name="us-east-1").create_bucket(Bucket=bucket)
    name = uuid.uuid4().hex[:8]
    with temporary_settings({PREFECT_API_URL: prefect_server}):
        creds = AwsCredentials(aws_access_key_id="AKIAKILNTEST", aws_secret_access_key=SECRET, region_name="us-east-1")
        KilnStore(url=f"s3://{bucket}/k", endpoint_url=proxy.endpoint_url, credentials=creds).save(f"store-{name}")
        # One bucket (not the recipe's four defaults) shows the block's buckets were the ones used.
        KilnRecipe(buckets="1x8", policy="fail", worker_host_mib=900).save(f"recipe-{name}")
    yield {"store": f"store-{name}", "recipe": f"recipe-{name}", "bucket": bucket, "proxy": proxy}
    proxy.__exit__(None, None, None)


def test_export_from_blocks_keeps_the_secret_out(kiln, blocks, prefect_server, s3_server, signing_key_env,
                                                 tmp_path):
    report = tmp_path / "r.json"
    env = {"PREFECT_API_URL": prefect_server, "AWS_ACCESS_KEY_ID": "", "AWS_SECRET_ACCESS_KEY": "",
           **signing_key_env}
    run = kiln("export", "--model", "tiny", "--tp", "2", "--store-block", blocks["store"],
               "--recipe-block", blocks["recipe"], "--policy", "borrow", "--set", "verify_atol=0.01", "--report",
               str(report), env=env)
    assert run.code == 0, run.err[-3000:]
    r = json.loads(report.read_text())
    assert [f["shapes"] for f in r["forwards"]] == ["1x8"]  # buckets from the recipe block
    assert r["gate"]["policy"] == "borrow"  # a flag given wins over the block's 'fail', also the default
    assert r["store"] == f"s3://{blocks['bucket']}/k"
    s3 = boto3.client("s3", endpoint_url=s3_server.endpoint_url, aws_access_key_id="x", aws_secret_access_key="y",
                      region_name="us-east-1")
    keys = [o["Key"] for o in s3.list_objects_v2(Bucket=blocks["bucket"])["Contents"]]
    assert sum(k.endswith(".pt2") for k in keys) == 1 and any(k.endswith("manifest.json") for k in keys)
    for text in (run.out, run.err, report.read_text()):
        assert SECRET not in text and signing_key_env["KILN_SIGNING_KEY"] not in text
    # The server accepts any credentials: the requests themselves show the block's were the ones used.
    assert blocks["proxy"].access_keys == {"AKIAKILNTEST"}


def test_missing_block_is_bad_input(kiln, prefect_server, tmp_path):
    run = kiln("export", "--model", "tiny", "--store-block", "no-such-block", env={"PREFECT_API_URL": prefect_server})
    assert run.code == 2, run.err[-2000:]
    assert "no Kiln Store block named 'no-such-block'" in run.err
