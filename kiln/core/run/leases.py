"""Compile leases: two exports of one model never compile the same key at the same time.

A lease is a create-once object `leases/<key>/<generation>.json` holding its
owner, its holder process (kiln.core.run.holders) and expiry. A key is leased when
its compile is submitted to a worker and the lease is renewed (rewritten with a
later expiry) while it compiles. Whoever creates generation g holds the key; a
lease whose holder is provably gone (past its expiry, or its process on this
host dead) is taken over by creating generation g+1, which exactly one
contender can do. The decisions here are pure; `kiln.host.phases.host_compile` does the I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.core.run.holders import holder_gone


def new_lease(owner: str, now_s: float, ttl_s: float, holder: dict | None = None) -> dict:
    """A lease document; `holder` (host, pid, started_at) lets a contender on its host see it die."""
    return {**(holder or {}), "owner": owner, "acquired_at": now_s, "expires_at": now_s + ttl_s}


def renewal_due(renewed_at_s: float, now_s: float, ttl_s: float) -> bool:
    """A held lease is rewritten every third of its TTL, so two missed renewals still leave it live."""
    return now_s - renewed_at_s >= ttl_s / 3


@dataclass(frozen=True)
class LeaseDecision:
    action: str
    """'hold' (already ours), 'wait' (someone else's, live), or 'create' (free or stale)."""
    generation: int
    """The generation to create when action is 'create'."""
    why: str | None = None
    """When taking over: why the previous holder is gone (for the log)."""


def decide_lease(latest: tuple[int, dict] | None, owner: str, now_s: float, *, host: str = "",
                 pid_started_at_s: float | None = None) -> LeaseDecision:
    """What to do about a key given its newest lease (generation, document), if any.

    `host` and `pid_started_at_s` are as in kiln.core.run.holders.holder_gone: this host, and the start
    time of the process with the lease's pid here now (None when there is none).
    """
    if latest is None:
        return LeaseDecision("create", 0)
    generation, doc = latest
    if doc.get("owner") == owner:
        return LeaseDecision("hold", generation)
    try:
        float(doc["expires_at"])
    except (KeyError, TypeError, ValueError):
        return LeaseDecision("create", generation + 1, "its lease is unreadable")  # it protects nothing
    why = holder_gone({**doc, "expires_at": float(doc["expires_at"])}, host=host, now_s=now_s,
                      pid_started_at_s=pid_started_at_s)
    return LeaseDecision("create" if why else "wait", generation + 1, why)
