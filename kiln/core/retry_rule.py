"""Which failures are retried: only those that can heal. Everything else is final.

Purpose: one rule for the I/O tasks' retries (`transient`, tasks/phases.py's
`transient_only`) and for the export flow's retries (`worth_retrying`,
flows/retry.py). An error not named here, a bug's TypeError or KeyError
among them, fails at its first try and is shown at once.

What can heal when the same call is tried again (`transient`):
- network: ConnectionError (reset, refused, broken pipe), TimeoutError, and the
  transport errors of botocore, urllib3 and httpx (matched by class name and
  module, so this module imports none of them);
- S3 answers that mean "later": throttling (SlowDown, ...) and 5xx, from a
  botocore ClientError's response;
- I/O OSErrors whose errno says the device or peer hiccuped (`TRANSIENT_ERRNOS`;
  a full or read-only disk is not among them: kiln.host.cache.DISK_ERRNOS);
- a lost Dask worker (KilledWorker, CommClosedError) and a killed worker
  process (BrokenProcessPool);
- a Kiln error whose instance says so (StoreError(transient=True): the store
  layer classifies the botocore error it wraps).

What heals only when the whole export runs again (`worth_retrying`, besides
the transient errors): hosts lost mid-compile (HostsLost), forwards missing
after the compile phase (ForwardsMissing), a forward that killed its compile
worker every attempt (kiln.host.compiler.CompileFailed: memory may be free
on the next try), and a gate refusal when the recipe waits for memory.

Pure: no prefect, boto3, distributed or torch import.
"""

from __future__ import annotations

import errno
from concurrent.futures.process import BrokenProcessPool

from kiln.core.errors import ForwardsMissing, GateRefused, HostsLost, KilnError

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

RERUN_HEALS = {"kiln.host.compiler": ("CompileFailed",)}
"""Kiln errors outside kiln.core that a re-run of the export may heal, by module and class name."""


def _named(exc: BaseException, table: dict[str, tuple[str, ...]], *, whole_module: bool = False) -> bool:
    for cls in type(exc).__mro__:
        module = cls.__module__ if whole_module else cls.__module__.split(".")[0]
        if cls.__name__ in table.get(module, ()):
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
    named there: a bug's TypeError or KeyError, a Kiln error not marked transient, a BaseException."""
    if isinstance(exc, KilnError):
        return getattr(exc, "transient", False) is True
    if not isinstance(exc, Exception):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError, BrokenProcessPool)):
        return True
    if _named(exc, TRANSIENT_CLASSES) or _retry_later_answer(exc):
        return True
    return isinstance(exc, OSError) and exc.errno in TRANSIENT_ERRNOS


def worth_retrying(exc: BaseException, *, retry_refusals: bool = False) -> bool:
    """Whether trying the whole export again may succeed: a transient error, lost hosts, forwards missing
    after compilation, a compile worker killed on every attempt; a gate refusal only with
    `retry_refusals` (the recipe setting: the deployment waits for memory). Everything else is final:
    bad input, integrity failures, verification mismatches, a full disk, a bug."""
    if isinstance(exc, GateRefused):
        return retry_refusals
    if isinstance(exc, (HostsLost, ForwardsMissing)) or _named(exc, RERUN_HEALS, whole_module=True):
        return True
    return transient(exc)
