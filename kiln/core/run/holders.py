"""Who holds a lease, and whether that holder is provably gone (pure decisions, no I/O).

A holder record names the process that holds a lease: `host` (its hostname),
`pid`, `started_at` (the process's start time, epoch seconds, so a reused pid
is not mistaken for the holder) and `expires_at` (epoch seconds; the holder
pushes it forward while it runs). The model lease (flows/model_lease.py) and
the compile leases per key (kiln.core.run.leases) both carry such a record.

A holder is provably gone when its process on this host is dead (no process
with its pid, or one started at another time), or when its record is past
expiry (a live process that stopped renewing has let go too). Anything else (a
holder on another host whose record has not expired, a record without these
fields and without expiry) is not proof: the caller waits.
Hostnames must be unique among the hosts that share a Prefect server or a store.
"""

from __future__ import annotations

from collections.abc import Mapping

START_TOLERANCE_S = 1.0
"""Start times are compared within this: an OS may report one process's start with sub-second jitter."""


def holder_record(host: str, pid: int, started_at_s: float, now_s: float, ttl_s: float) -> dict:
    """The record of a holder process that will renew it before `now_s + ttl_s`."""
    return {"host": host, "pid": pid, "started_at": started_at_s, "expires_at": now_s + ttl_s}


def holder_gone(holder: Mapping, *, host: str, now_s: float, pid_started_at_s: float | None) -> str | None:
    """Why `holder` is provably gone, or None when it may still hold its lease.

    `host` is this host's name; `pid_started_at_s` is the start time of the process that has the
    holder's pid on this host now (None when there is none), looked up by the caller only when the
    holder's host is this one (it is ignored otherwise).
    """
    pid, started = holder.get("pid"), holder.get("started_at")
    if holder.get("host") == host and isinstance(pid, int) and isinstance(started, (int, float)):
        if pid_started_at_s is None:
            return f"its process {pid} on {host} is gone"
        if abs(pid_started_at_s - started) > START_TOLERANCE_S:
            return f"its process {pid} on {host} is gone (pid {pid} is now another process)"
    expires = holder.get("expires_at")
    if isinstance(expires, (int, float)) and not isinstance(expires, bool) and expires <= now_s:
        return f"its lease expired {now_s - expires:.0f} s ago"
    return None


def describe(holder: Mapping) -> str:
    """Who holds a lease, for log lines: its flow run and export (when the record names them), since when,
    and its process and host (when it names one); 'another export' for an empty record."""
    if not holder:
        return "another export"
    parts = []
    if holder.get("flow_run_name") or holder.get("flow_run_id"):
        parts.append(f"flow run {holder.get('flow_run_name')} ({holder.get('flow_run_id')})")
    if holder.get("export_id") or holder.get("owner"):
        parts.append(f"export {holder.get('export_id') or holder.get('owner')}")
    if holder.get("since"):
        parts.append(f"since {holder['since']}")
    if holder.get("pid"):
        parts.append(f"process {holder['pid']} on {holder.get('host')}")
    return ", ".join(parts) or "a holder whose record names no process"
