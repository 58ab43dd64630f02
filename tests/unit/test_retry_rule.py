"""Only what can heal is retried, at one level (kiln.core.run.retry_rule): real third-party error classes, matched by
name."""

from __future__ import annotations

import errno
import pickle
from concurrent.futures.process import BrokenProcessPool

import httpx
import pytest
from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError, ReadTimeoutError
from distributed.comm.core import CommClosedError
from distributed.scheduler import KilledWorker

from kiln.core.errors import BadInput, CheckCrashed, HostsLost, IntegrityError, StoreError
from kiln.core.run.retry_rule import (
    mark_retried_in_task,
    retried_in_task,
    retried_per_request,
    retry_in_task,
    transient,
    worth_retrying,
)
from kiln.host.compile.compiler import CompileFailed


def _client_error(code: str, status: int) -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": "m"}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "PutObject")


RETRIED_PER_REQUEST = [EndpointConnectionError(endpoint_url="http://127.0.0.1:1"),
                       ReadTimeoutError(endpoint_url="http://127.0.0.1:1"), _client_error("SlowDown", 503),
                       _client_error("InternalError", 500), StoreError("unreachable", transient=True)]
"""Transient, but out of a call that spent its per-request retries (botocore's, the store's)."""
HEALS = [ConnectionResetError(), BrokenPipeError(), TimeoutError(), OSError(errno.EIO, "Input/output error"),
         OSError(errno.ESTALE, "Stale file handle"), httpx.ConnectError("refused"), KilledWorker("t", None, 3),
         CommClosedError("gone")]
"""Transient, and retried by the one level above where they happen."""
FINAL = [TypeError("bug"), KeyError("bug"), AttributeError("bug"), ValueError("bug"), ZeroDivisionError(),
         RuntimeError("?"), OSError(errno.ENOSPC, "No space left"), FileNotFoundError(errno.ENOENT, "gone"),
         PermissionError(errno.EACCES, "denied"), _client_error("AccessDenied", 403), NoCredentialsError(),
         StoreError("access denied"), BadInput("x"), IntegrityError("x"), KeyboardInterrupt(), SystemExit(1),
         BrokenProcessPool("a worker died"), CheckCrashed("rank 0 died"), CompileFailed("killed every attempt")]


@pytest.mark.parametrize("exc", HEALS, ids=lambda e: type(e).__name__)
def test_what_can_heal_is_transient_and_retried_by_a_task_or_else_the_flow(exc):
    assert transient(exc) and retry_in_task(exc) and worth_retrying(exc)


@pytest.mark.parametrize("exc", RETRIED_PER_REQUEST, ids=lambda e: type(e).__name__)
def test_what_botocore_or_the_store_retried_is_not_retried_again(exc):
    # The per-request level spent its budget: neither the I/O task nor the export flow multiplies it.
    assert transient(exc) and retried_per_request(exc)
    assert not retry_in_task(exc) and not worth_retrying(exc)


@pytest.mark.parametrize("exc", FINAL, ids=lambda e: type(e).__name__)
def test_everything_else_is_final(exc):
    assert not transient(exc) and not retry_in_task(exc) and not worth_retrying(exc)


def test_a_crash_is_final_at_every_level():
    # A package that crashes the rank check (its process died: BrokenProcessPool, or the CheckCrashed that
    # names it) would crash the same way on each of the flow's tries.
    for crash in (BrokenProcessPool("A process in the process pool was terminated abruptly"),
                  CheckCrashed("host-0: the check of rank 1 died")):
        assert not transient(crash) and not worth_retrying(crash) and not worth_retrying(crash, retry_refusals=True)


def test_what_an_io_task_retried_is_not_retried_by_the_flow():
    exc = ConnectionResetError(104, "Connection reset by peer")
    mark_retried_in_task(exc)
    assert retried_in_task(exc) and retry_in_task(exc)  # the task's own condition still retries it
    assert not worth_retrying(exc)  # but once it escapes the task, the flow does not
    # The mark crosses processes with the exception (Dask, Prefect's results pickle it).
    assert not worth_retrying(pickle.loads(pickle.dumps(exc)))
    assert worth_retrying(ConnectionResetError(104, "Connection reset by peer"))  # raised outside any I/O task


def test_one_store_call_is_tried_at_most_its_per_request_budget():
    # botocore x task x flow used to reach 8 x 4 x 3 = 96 tries of one store call: now only botocore's 8.
    from kiln.core.plan.recipe import Recipe
    from kiln.store.s3_client import REQUEST_RETRIES

    after_botocore = StoreError("S3 get failed: SlowDown", transient=True)
    task_tries = 1 + (3 if retry_in_task(after_botocore) else 0)  # tasks.phases.IO_RETRY_DELAYS_S: 3 more
    flow_tries = 1 + (Recipe().flow_retries if worth_retrying(after_botocore) else 0)
    assert REQUEST_RETRIES["max_attempts"] * task_tries * flow_tries == REQUEST_RETRIES["max_attempts"] == 8


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
