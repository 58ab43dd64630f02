"""Which failures are retried, and at which level: only those that can heal, each at one level.

Purpose: one rule for the store's per-request retries (`transient`, which the
S3 store and checkpoint reader use to classify what botocore gave up on), the
I/O tasks' retries (`retry_in_task`, tasks/phases.py's `transient_only`) and
the export flow's retries (`worth_retrying`, flows/retry.py). An error not
named here, a bug's TypeError or KeyError among them, fails at its first try
and is shown at once. So do a refusal, bad input, a verify mismatch and a
crash (a process that died: BrokenProcessPool, a compile worker killed on
every attempt): they are never retried.

What can heal when the same call is tried again (`transient`):
- network: ConnectionError (reset, refused, broken pipe), TimeoutError, and the
  transport errors of botocore, urllib3 and httpx (matched by class name and
  module, so this module imports none of them);
- S3 answers that mean "later": throttling (SlowDown, ...) and 5xx, from a
  botocore ClientError's response;
- I/O OSErrors whose errno says the device or peer hiccuped (`TRANSIENT_ERRNOS`;
  a full or read-only disk is not among them: kiln.core.errors.DISK_ERRNOS);
- a lost Dask worker (KilledWorker, CommClosedError);
- a Kiln error whose instance says so (StoreError(transient=True): the store
  layer classifies the botocore error it wraps).

One level per failure, each with its budget (attempts never multiply):
1. A request to S3 (the store, an S3 checkpoint): botocore's retries, standard
   mode, `kiln.store.s3_client.REQUEST_RETRIES` (8 tries, random backoff doubling up
   to 20 s), plus Kiln's own re-GET of a body that breaks off
   (`READ_ATTEMPTS`, 5). What the store raises after that (a StoreError,
   transient or not, or a botocore error) has spent its budget:
   `retried_per_request` is true and no task or flow retries it again.
2. Other transient I/O inside an I/O task (an EIO on a cache or file store, a
   reset connection that no client retried): the task's retries
   (tasks.phases.IO_RETRY_DELAYS_S: 3 more tries). The task marks what escapes
   it (`mark_retried_in_task`), so the flow does not retry it again.
3. The export flow (`flow_retries`, default 2 more tries): what only a new try
   heals (hosts lost mid-compile, forwards missing after the compile phase, a
   gate refusal when the recipe waits for memory), and transient errors that
   no level below retried (raised outside the I/O tasks and outside the store).

A crash is final at every level. A compile worker killed mid-compile has its
own level, inside the compile pool (the forward is compiled again on a fresh
worker, `max_compile_attempts` times in all: an OOM kill may not recur once
the other workers finished); the CompileFailed raised after that is final, not
re-run by the flow, which would multiply that budget by the flow's tries, each
a compile that may take the host's memory down again. A rank check whose
process died (a package that segfaults when loaded) is final at once, and so
is a step stopped past its deadline (DeadlinePassed, kiln.core.plan.deadlines):
what hung would hang again.

Pure: no prefect, boto3, distributed or torch import.
"""

from __future__ import annotations

import errno

from kiln.core.errors import ForwardsMissing, GateRefused, HostsLost, KilnError, StoreError

TRANSIENT_ERRNOS = frozenset({
    errno.EIO, errno.EAGAIN, errno.EINTR, errno.EBUSY, errno.ETIMEDOUT, errno.ECONNRESET, errno.ECONNREFUSED,
    errno.ECONNABORTED, errno.EPIPE, errno.ENETDOWN, errno.ENETUNREACH, errno.ENETRESET, errno.EHOSTDOWN,
    errno.EHOSTUNREACH, errno.ESTALE,
})
"""OSError numbers of a hiccup (device, network or NFS server), not of a wrong path or a full disk."""

TRANSIENT_CLASSES = {
    "botocore": ("ConnectionError", "HTTPClientError", "ConnectionClosedError", "ReadTimeoutError",
                 "ConnectTimeoutError", "EndpointConnectionError", "ResponseStreamingError",
                 "IncompleteReadError"),
    "urllib3": ("ProtocolError", "TimeoutError", "NewConnectionError", "ReadTimeoutError"),
    "httpx": ("TransportError",),
    "distributed": ("KilledWorker", "CommClosedError"),
}
"""Third-party errors that can heal, by top-level package and class name (any class in the error's MRO)."""

RETRY_LATER_CODES = frozenset({"SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded",
                               "RequestTimeout", "InternalError", "ServiceUnavailable", "503", "500"})
"""S3 error codes that mean "try again later" (botocore ClientError's Error.Code)."""

RETRIED_PER_REQUEST = ("botocore",)
"""Packages whose errors come out of a client that retried the request itself (botocore: REQUEST_RETRIES)."""

_RETRIED_IN_TASK = "kiln_retried_in_task"


def _named(exc: BaseException, table: dict[str, tuple[str, ...]]) -> bool:
    for cls in type(exc).__mro__:
        if cls.__name__ in table.get(cls.__module__.split(".")[0], ()):
            return True
    return False


def _retry_later_answer(exc: BaseException) -> bool:
    """A botocore ClientError (duck-typed: its `response` dict) whose code or HTTP status says "later"."""
    response = getattr(exc, "response", None)
    if not isinstance(response, dict) or type(exc).__name__ != "ClientError":
        return False
    code = str((response.get("Error") or {}).get("Code", ""))
    status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
    return code in RETRY_LATER_CODES or (isinstance(status, int) and status >= 500)


def transient(exc: BaseException) -> bool:
    """Whether trying the same call again may succeed (see the module docstring). False for anything not
    named there: a bug's TypeError or KeyError, a crashed process (BrokenProcessPool), a Kiln error not
    marked transient, a BaseException."""
    if isinstance(exc, KilnError):
        return getattr(exc, "transient", False) is True
    if not isinstance(exc, Exception):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError)):
        return True
    if _named(exc, TRANSIENT_CLASSES) or _retry_later_answer(exc):
        return True
    return isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS


def retried_per_request(exc: BaseException) -> bool:
    """Whether `exc` comes out of a call that already spent its per-request retries: any StoreError (the
    store raises one only after botocore's retries and its own re-reads) and any botocore error."""
    return isinstance(exc, StoreError) or any(cls.__module__.split(".")[0] in RETRIED_PER_REQUEST
                                              for cls in type(exc).__mro__)


def mark_retried_in_task(exc: BaseException) -> None:
    """Record on `exc` that an I/O task with retries raised it (an instance attribute: it survives pickling)."""
    try:
        setattr(exc, _RETRIED_IN_TASK, True)
    except AttributeError:  # an exception type without a __dict__: the flow may retry it once more
        pass


def retried_in_task(exc: BaseException) -> bool:
    """Whether an I/O task raised `exc` (mark_retried_in_task): the task's retries were its level."""
    return getattr(exc, _RETRIED_IN_TASK, False) is True


def retry_in_task(exc: BaseException) -> bool:
    """Whether an I/O task tries again after `exc`: transient, and not already retried per request."""
    return transient(exc) and not retried_per_request(exc)


def worth_retrying(exc: BaseException, *, retry_refusals: bool = False) -> bool:
    """Whether trying the whole export again may succeed: lost hosts, forwards missing after compilation,
    a gate refusal only with `retry_refusals` (the recipe setting: the deployment waits for memory), and
    a transient error that no level below retried (not a store or botocore error, not raised by an I/O
    task). Everything else is final: bad input, integrity failures, verification mismatches, a crash
    (a worker or check process that died, CompileFailed), a full disk, a bug."""
    if isinstance(exc, GateRefused):
        return retry_refusals
    if isinstance(exc, (HostsLost, ForwardsMissing)):
        return True
    return transient(exc) and not retried_per_request(exc) and not retried_in_task(exc)
