"""Compile leases: two exports of one model never compile the same key at the same time.

A lease is a create-once object `leases/<key>/<generation>.json` holding its
owner and expiry. Whoever creates generation g holds the key; a stale lease
(past its expiry) is taken over by creating generation g+1, which exactly one
contender can do. The decisions here are pure; `tasks.hostwork` does the I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

PREFIX = "leases/"


def lease_prefix(key: str) -> str:
    return f"{PREFIX}{key}/"


def lease_key(key: str, generation: int) -> str:
    return f"{PREFIX}{key}/{generation:08d}.json"


def generation_of(object_key: str) -> int:
    return int(object_key.rsplit("/", 1)[-1].removesuffix(".json"))


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
