"""How Kiln talks to S3, for the store (kiln.store.s3) and an S3 checkpoint (kiln.host.weights.s3_checkpoint).

One botocore client per store or checkpoint (`make_client`): path-style
addressing, botocore's standard retries per request (REQUEST_RETRIES), a
connection per part in flight, and S3's API model parsed once per process. A
GET whose body breaks off while it is read is requested again (`read_body`,
READ_ATTEMPTS GETs in all): botocore retries requests, not bodies.

Contracts: these are the only retries of an S3 request (kiln.core.run.retry_rule);
what outlasts them is raised as it came, for the caller to name.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any, TypeVar

import botocore.session
from botocore.config import Config
from botocore.exceptions import (
    ClientError,
    ConnectionClosedError,
    IncompleteReadError,
    ReadTimeoutError,
    ResponseStreamingError,
)
from urllib3.exceptions import HTTPError as Urllib3Error

from kiln.store.s3_errors import blip, explain_check_error

REQUEST_RETRIES = {"mode": "standard", "max_attempts": 8}
"""botocore's retries of one S3 request (the store's and an S3 checkpoint's): the only level that retries it."""
READ_ATTEMPTS = 5
"""GETs of one object or range whose body breaks off while it is read, before the read fails."""
BODY_ERRORS = (ResponseStreamingError, IncompleteReadError, ReadTimeoutError, ConnectionClosedError, Urllib3Error)
"""A response body that breaks off while it is read; botocore does not retry these (READ_ATTEMPTS does)."""
QUICK_CHECK = Config(connect_timeout=2, read_timeout=5, retries={"mode": "standard", "max_attempts": 2})
"""A bucket check's client: few retries and short timeouts, so a wrong endpoint fails in seconds, not minutes."""

T = TypeVar("T")


def client_config(*, max_concurrency: int, max_attempts: int = REQUEST_RETRIES["max_attempts"],
                  checksum_mode: str | None = None) -> Config:
    """botocore's settings for Kiln's S3 clients; `checksum_mode` None keeps botocore's default."""
    checksums = {} if checksum_mode is None else {"request_checksum_calculation": checksum_mode,
                                                  "response_checksum_validation": checksum_mode}
    return Config(retries={**REQUEST_RETRIES, "max_attempts": max_attempts}, s3={"addressing_style": "path"},
                  max_pool_connections=max(10, max_concurrency),  # one connection per part in flight
                  **checksums)


def make_client(config: Config, *, region: str | None = None, endpoint_url: str | None = None,
                **credentials: str | None) -> Any:
    """An S3 client of its own session (credential chains kept apart) sharing the parsed API models;
    `credentials` are botocore's aws_access_key_id, aws_secret_access_key, aws_session_token."""
    session = botocore.session.get_session()
    session.register_component("data_loader", _api_model_loader())
    return session.create_client("s3", region_name=region, endpoint_url=endpoint_url, config=config,
                                 **credentials)


def read_body(get: Callable[[], dict], read: Callable[[Any], T], attempts: int = READ_ATTEMPTS) -> tuple[dict, T]:
    """(`get()`'s response, `read(its body)`); when the body breaks off (BODY_ERRORS), it is closed and `get`
    called again, `attempts` times in all, the last error raised. `read` may see the start of a body twice."""
    for attempt in range(1, attempts + 1):
        resp = get()
        try:
            return resp, read(resp["Body"])
        except BODY_ERRORS:
            resp["Body"].close()
            if attempt == attempts:
                raise
        time.sleep(min(0.1 * 2**attempt, 2.0))
    raise AssertionError("unreachable")


def check_bucket(bucket: str, endpoint_url: str | None, *, quick: Callable[[], Any],
                 patient: Callable[[], Any]) -> None:
    """HEAD the bucket with the `quick()` client (QUICK_CHECK); an answer meaning "later" (5xx, throttling) says
    the endpoint is right and busy, so the `patient()` client, with the store's own budget, asks again.
    What fails is raised explained (kiln.store.s3_errors.explain_check_error) where it can be."""
    endpoint = endpoint_url or "the default AWS endpoint"
    try:
        client = quick()
        endpoint = client.meta.endpoint_url
        try:
            client.head_bucket(Bucket=bucket)
        except ClientError as e:
            if not blip(e):
                raise
            patient().head_bucket(Bucket=bucket)
    except Exception as e:
        if (explained := explain_check_error(e, bucket, endpoint)) is not None:
            raise explained from None
        raise


@functools.cache
def _api_model_loader() -> Any:
    """botocore's loader of API models, one per process: a fresh session parses S3's model again (~0.1 s)."""
    return botocore.session.get_session().get_component("data_loader")
