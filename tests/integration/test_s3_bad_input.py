"""S3 stores that cannot work are bad input from the CLI: exit 2, the reason named, before anything runs.

Each case runs `kiln export` (and `kiln plan`) through `cli.main.main(argv)` in this process
(`kiln_main`; the refusals come before Prefect starts, and tests/integration/test_bad_input.py keeps
the subprocess case of exit code 2), against a real S3 server process (moto_server) where a server
is involved.
"""

from __future__ import annotations

import uuid

import boto3
import pytest
from conftest import free_port

AWS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


def _refused(run, *needles: str) -> None:
    assert run.code == 2, (run.code, run.err[-2000:])
    assert "Traceback" not in run.err
    for needle in needles:
        assert needle in run.err, run.err[-2000:]
    assert "Beginning flow run" not in run.err + run.out, "refused only after the orchestrator started"


def _export(kiln_main, store: str, *extra: str, env: dict):
    return kiln_main("export", "--tp", "2", "--buckets", "1x8", "--store", store, "--unsigned", *extra, env=env)


def test_a_missing_bucket_is_named(kiln_main, s3_server):
    env = {**AWS, "AWS_ENDPOINT_URL": s3_server.endpoint_url}
    run = _export(kiln_main, "s3://kiln-no-such-bucket/x", env=env)
    _refused(run, "bucket 'kiln-no-such-bucket' does not exist", s3_server.endpoint_url)
    plan = kiln_main("plan", "--tp", "2", "--store", "s3://kiln-no-such-bucket/x", env=env)
    assert plan.code == 2 and "does not exist" in plan.err


def test_an_unreachable_endpoint_is_named(kiln_main):
    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    run = _export(kiln_main, "s3://kiln-bucket/x", "--s3-endpoint", endpoint, env=AWS)
    _refused(run, f"cannot reach S3 endpoint {endpoint}", "--s3-endpoint")


def test_credentials_the_server_refuses_are_named(kiln_main, s3_server_factory):
    # A moto server that checks credentials (IAM auth from its first request on): 'testing' is nobody's key.
    server = s3_server_factory({"INITIAL_NO_AUTH_ACTION_COUNT": "0"})
    bucket = f"kiln-auth-{uuid.uuid4().hex[:8]}"
    with pytest.raises(Exception):  # the server really refuses these credentials
        boto3.client("s3", endpoint_url=server.endpoint_url, **{k.lower(): v for k, v in AWS.items()
                                                                if k != "AWS_DEFAULT_REGION"},
                     region_name="us-east-1").create_bucket(Bucket=bucket)
    run = _export(kiln_main, f"s3://{bucket}/x", env={**AWS, "AWS_ENDPOINT_URL": server.endpoint_url})
    _refused(run, "refused the credentials", "AWS_ACCESS_KEY_ID")
