"""Compile leases: two exports of one model never compile the same key at the same time.

A lease is a create-once object `leases/<key>/<generation>.json` holding its
owner and expiry. Whoever creates generation g holds the key; a stale lease
(past its expiry) is taken over by creating generation g+1, which exactly one
contender can do. The decisions here are pure; `tasks.hostwork` does the I/O.
"""

from __future__ import annotations

from dataclasses import dataclass


def new_lease(owner: str, now_s: float, ttl_s: float) -> dict:
    return {"owner": owner, "acquired_at": now_s, "expires_at": now_s + ttl_s}


@dataclass(frozen=True)
class LeaseDecision:
    action: str
    """'hold' (already ours), 'wait' (someone else's, live), or 'create' (free or stale)."""
    generation: int
    """The generation to create when action is 'create'."""


def decide_lease(latest: tuple[int, dict] | None, owner: str, now_s: float) -> LeaseDecision:
    """What to do about a key given its newest lease (generation, document), if any."""
    if latest is None:
        return LeaseDecision("create", 0)
    generation, doc = latest
    if doc.get("owner") == owner:
        return LeaseDecision("hold", generation)
    try:
        expired = float(doc["expires_at"]) <= now_s
    except (KeyError, TypeError, ValueError):
        expired = True  # an unreadable lease protects nothing
    return LeaseDecision("create" if expired else "wait", generation + 1)
