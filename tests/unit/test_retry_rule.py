"""Only what can heal is retried (kiln.core.retry_rule): real third-party error classes, matched by name."""

from __future__ import annotations

import errno
import pickle
from concurrent.futures.process import BrokenProcessPool

import httpx
import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError, ReadTimeoutError
from distributed.comm.core import CommClosedError
from distributed.scheduler import KilledWorker

from kiln.core.errors import BadInput, HostsLost, IntegrityError, StoreError
from kiln.core.retry_rule import transient, worth_retrying


def _client_error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "PutObject")


HEALS = [ConnectionResetError(), BrokenPipeError(), TimeoutError(), OSError(errno.EIO, "Input/output error"),
         OSError(errno.ESTALE, "Stale file handle"), EndpointConnectionError(endpoint_url="http://127.0.0.1:1"),
         ReadTimeoutError(endpoint_url="http://127.0.0.1:1"), _client_error("SlowDown", 503),
         _client_error("InternalError", 500), httpx.ConnectError("refused"), KilledWorker("t", None, 3),
         CommClosedError("gone"), BrokenProcessPool("a worker died"), StoreError("unreachable", transient=True)]
FINAL = [TypeError("bug"), KeyError("bug"), AttributeError("bug"), ValueError("bug"), ZeroDivisionError(),
         RuntimeError("?"), OSError(errno.ENOSPC, "No space left"), FileNotFoundError(errno.ENOENT, "gone"),
         PermissionError(errno.EACCES, "denied"), _client_error("AccessDenied", 403), NoCredentialsError(),
         StoreError("access denied"), BadInput("x"), IntegrityError("x"), KeyboardInterrupt(), SystemExit(1)]


@pytest.mark.parametrize("exc", HEALS, ids=lambda e: type(e).__name__)
def test_what_can_heal_is_transient(exc):
    assert transient(exc) and worth_retrying(exc)


@pytest.mark.parametrize("exc", FINAL, ids=lambda e: type(e).__name__)
def test_everything_else_is_final(exc):
    assert not transient(exc) and not worth_retrying(exc)


def test_a_lost_host_heals_by_a_rerun_not_by_a_task_retry():
    assert worth_retrying(HostsLost("host-1 gone")) and not transient(HostsLost("host-1 gone"))


def test_a_store_errors_verdict_survives_pickling():
    # Task results cross processes (Dask, Prefect's result store) pickled, and pickling drops __cause__.
    assert transient(pickle.loads(pickle.dumps(StoreError("unreachable", transient=True))))
    assert not transient(pickle.loads(pickle.dumps(StoreError("denied"))))


def test_an_unreachable_s3_store_fails_with_a_transient_store_error():
    import socket

    from kiln.store.s3 import S3Store

    with socket.socket() as s:  # a loopback port nothing listens on: the connection is refused at once
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = S3Store("kiln-test", endpoint_url=f"http://127.0.0.1:{port}", region="us-east-1", access_key="k",
                    secret_key="s", max_attempts=1)
    with pytest.raises(StoreError) as info:
        store.get_bytes("forwards/x.pt2")
    assert info.value.transient and transient(info.value)
