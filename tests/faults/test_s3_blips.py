"""Fault 3b: S3 answers "later" (503 SlowDown) in bursts while an export prepares.

A burst is a blip, not bad input: `prepare` (flows/params.py) reads the checkpoint from S3 and checks the
store through the fault proxy (tests/s3_fault_proxy.py, moto behind it), each request is retried by botocore
(kiln.store.s3_client.REQUEST_RETRIES) and prepare succeeds. No compile: the job is built and nothing runs.
"""

from __future__ import annotations

from urllib.parse import urlparse

import boto3
import pytest
from s3_fault_proxy import FaultProxy

from kiln.core.model.config import TINY


@pytest.fixture
def tiny_in_s3(s3_server, s3_bucket, tmp_path) -> str:
    """A one-layer TINY checkpoint uploaded under s3://BUCKET/ckpt/tiny; returns the bucket."""
    from kiln.host.weights.checkpoint import random_checkpoint

    bucket = s3_bucket[5:].split("/")[0]
    folder = random_checkpoint(tmp_path / "tiny", TINY.replace(num_layers=1, vocab_size=64), seed=1)
    client = boto3.client("s3", endpoint_url=s3_server.endpoint_url)
    for f in sorted(folder.iterdir()):
        client.upload_file(str(f), bucket, f"ckpt/tiny/{f.name}")
    return bucket


def test_a_503_burst_during_prepare_is_retried_and_prepare_succeeds(s3_server, tiny_in_s3, tmp_path, monkeypatch):
    from flows.params import ExportParams, prepare
    from kiln.store.s3 import S3Store

    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    bucket = tiny_in_s3
    with FaultProxy(urlparse(s3_server.endpoint_url).port) as proxy:
        real_check = S3Store.check

        def check_in_a_burst(store: S3Store) -> None:
            # A second burst, placed on the store check: it answers "later" more often than the check's two
            # quick tries (a wrong endpoint must still fail in seconds) and must be retried all the same.
            proxy.arm(max_faults=3, cycle=("503",))
            real_check(store)

        monkeypatch.setattr(S3Store, "check", check_in_a_burst)
        proxy.arm(max_faults=3, cycle=("503",))  # the first: the checkpoint's listing, when prepare starts
        params = ExportParams(model=f"s3://{bucket}/ckpt/tiny", tp=2, store=f"s3://{bucket}/exports",
                              s3_endpoint=proxy.endpoint_url)
        job, hosts = prepare(params, host_names=None, signing=False)
        fired = proxy.fired["503"]
    assert fired == 6, proxy.fired  # both bursts really happened, in full
    assert job.store_url == f"s3://{bucket}/exports" and job.checkpoint == f"s3://{bucket}/ckpt/tiny"
    assert job.model_config.num_layers == 1 and hosts == []
    assert {o["name"] for o in job.checkpoint_identity["objects"]} >= {"config.json"}
