"""Fault injection for tests of retries and resumption; does nothing unless its variables are set.

- KILN_FAULT_AFTER_UPLOADS=N: the compile phase raises a transient error
  (ConnectionError, as a dropped connection to the store would) right after
  its N-th upload, once per process. The forwards uploaded so far stay in the
  store; a retry or re-run must compile only the rest.
- KILN_FAULT_PROBE_ERRORS=N: the first N probes in this process fail with a
  transient store error before touching anything.
- KILN_FAULT_DIE_AFTER_UPLOADS=N: the host's process kills itself (SIGKILL)
  right after its N-th upload: a host lost mid-compile.

"Once per process" matters: Prefect retries a flow or task in the same
process, so the retry runs without the fault.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Callable

_fired: dict[str, int] = {}


def _limit(name: str) -> int:
    raw = os.environ.get(name, "").strip()
    return int(raw) if raw.isdigit() else 0


def after_uploads() -> Callable[[object], None] | None:
    """An `on_done` hook for hostwork.compile_on_host, or None when KILN_FAULT_AFTER_UPLOADS is unset."""
    limit = _limit("KILN_FAULT_AFTER_UPLOADS")
    if not limit or _fired.get("uploads"):
        return None
    count = 0

    def hook(result) -> None:
        nonlocal count
        count += 1
        if count >= limit and not _fired.get("uploads"):
            _fired["uploads"] = 1
            raise ConnectionError(f"injected fault (KILN_FAULT_AFTER_UPLOADS={limit}): "
                                  f"connection lost after {count} upload(s)")
    return hook


def probe() -> None:
    """Raise a transient store error for the first KILN_FAULT_PROBE_ERRORS calls in this process."""
    limit = _limit("KILN_FAULT_PROBE_ERRORS")
    if _fired.get("probe", 0) < limit:
        _fired["probe"] = _fired.get("probe", 0) + 1
        raise ConnectionError(f"injected fault (KILN_FAULT_PROBE_ERRORS={limit}): store unreachable "
                              f"(probe {_fired['probe']} of {limit})")


def die_after_uploads(num_uploaded: int) -> None:
    """SIGKILL this process once it has uploaded KILN_FAULT_DIE_AFTER_UPLOADS artifacts."""
    limit = _limit("KILN_FAULT_DIE_AFTER_UPLOADS")
    if limit and num_uploaded >= limit:
        os.kill(os.getpid(), signal.SIGKILL)
