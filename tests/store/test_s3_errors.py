"""What S3 failures mean (kiln/store/s3_errors.py, kiln/host/weights/s3_checkpoint.read_failure): what a user must fix is
BadInput; a blip that outlasted botocore's retries is a transient StoreError. Real botocore error objects, no server.
"""

from __future__ import annotations

import pytest
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    ConnectTimeoutError,
    EndpointConnectionError,
    InvalidEndpointConfigurationError,
    NoCredentialsError,
    ReadTimeoutError,
    ResponseStreamingError,
)

from kiln.core.errors import BadInput, StoreError
from kiln.core.run.retry_rule import retry_in_task, worth_retrying
from kiln.host.weights.s3_checkpoint import read_failure
from kiln.store.s3_errors import explain_check_error

ENDPOINT = "http://127.0.0.1:9"


def _client_error(code: str, status: int, *, s3_headers: bool = True) -> ClientError:
    headers = {"x-amz-request-id": "r1"} if s3_headers else {}
    return ClientError({"Error": {"Code": code, "Message": "m"},
                        "ResponseMetadata": {"HTTPStatusCode": status, "HTTPHeaders": headers}}, "HeadBucket")


def _id(e: Exception) -> str:
    return f"{type(e).__name__}-{e.response['Error']['Code']}" if isinstance(e, ClientError) else type(e).__name__


BLIPS = [ReadTimeoutError(endpoint_url=ENDPOINT), ConnectionClosedError(endpoint_url=ENDPOINT),
         ResponseStreamingError(error="reset"), _client_error("503", 503), _client_error("SlowDown", 503),
         _client_error("InternalError", 500), _client_error("502", 502)]
TO_FIX = [NoCredentialsError(), EndpointConnectionError(endpoint_url=ENDPOINT),
          ConnectTimeoutError(endpoint_url=ENDPOINT),
          _client_error("NoSuchBucket", 404), _client_error("404", 404, s3_headers=False),
          _client_error("AccessDenied", 403), _client_error("PermanentRedirect", 301),
          _client_error("InvalidRequest", 400), InvalidEndpointConfigurationError(msg="bad url")]


@pytest.mark.parametrize("exc", BLIPS, ids=_id)
def test_a_blip_is_a_transient_store_error_not_bad_input(exc):
    for error in (explain_check_error(exc, "b", ENDPOINT), read_failure(exc, "read s3://b/ckpt/config.json", "fix")):
        assert type(error) is StoreError and error.transient, error
        assert "try again later" in str(error)
        # Its retries were botocore's: the task and the flow do not multiply them.
        assert not retry_in_task(error) and not worth_retrying(error)


@pytest.mark.parametrize("exc", TO_FIX, ids=_id)
def test_what_the_user_must_fix_is_bad_input(exc):
    for error in (explain_check_error(exc, "b", ENDPOINT), read_failure(exc, "read s3://b/ckpt/config.json", "fix")):
        assert isinstance(error, BadInput), error
        assert not worth_retrying(error)


def test_a_missing_or_replaced_checkpoint_object_is_bad_input():
    for code, status in (("NoSuchKey", 404), ("PreconditionFailed", 412)):
        error = read_failure(_client_error(code, status), "read s3://b/ckpt/model.safetensors", "check it exists")
        assert isinstance(error, BadInput) and "s3://b/ckpt/model.safetensors" in str(error)


def test_a_body_that_keeps_breaking_off_is_read_again_then_a_transient_error(monkeypatch):
    from kiln.host.weights.s3_checkpoint import S3Checkpoint
    from kiln.store import s3_client
    from kiln.store.s3_client import READ_ATTEMPTS

    class Body:
        def read(self, amt=None):
            raise ReadTimeoutError(endpoint_url=ENDPOINT)

        def close(self):
            pass

    class Client:
        gets = 0

        def get_object(self, **_):
            Client.gets += 1
            return {"Body": Body()}

    monkeypatch.setattr(s3_client.time, "sleep", lambda s: None)  # the backoff between GETs
    ck = S3Checkpoint.__new__(S3Checkpoint)  # no listing: only _get is under test
    ck.url, ck.bucket, ck.prefix, ck.objects, ck._client = "s3://b/ckpt", "b", "ckpt/", {}, Client()
    with pytest.raises(StoreError) as info:
        ck._get("config.json")
    assert info.value.transient and Client.gets == READ_ATTEMPTS
