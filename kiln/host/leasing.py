"""Compile leases in the store, per key: taken when a key's compile is submitted, renewed while it compiles.

The I/O side of kiln.core.leases (the decisions) and kiln.core.holders (is a
holder provably gone). `compile_leased` drives a CompilePool under these
leases; `tasks.hostwork.compile_on_host` calls it on each host.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from kiln.core import layout, leases
from kiln.core.errors import IntegrityError
from kiln.core.holders import describe
from kiln.core.layout import artifact_key
from kiln.host import procs
from kiln.host.compiler import CompilePool, CompileResult
from kiln.store import ObjectMissing

log = logging.getLogger(__name__)


class Leases:
    """Compile leases of one host in one export (see kiln.core.leases): taken per key when its compile
    is submitted, renewed every third of `ttl_s` while it compiles (`renew_due`), released on upload."""

    def __init__(self, store, owner: str, ttl_s: float):
        self.store, self.owner, self.ttl_s = store, owner, ttl_s
        self.me = procs.this_process()
        self.held: dict[str, tuple[int, float]] = {}
        """key -> (generation, when it was last written) of each lease held now."""

    def acquire(self, key: str) -> bool:
        existing = sorted(self.store.list(layout.lease_prefix(key)))
        latest = None
        if existing:
            try:
                latest = (layout.generation_of(existing[-1]), self.store.get_json(existing[-1]))
            except (IntegrityError, ObjectMissing):
                latest = (layout.generation_of(existing[-1]), {})
        doc = latest[1] if latest else {}
        decision = leases.decide_lease(latest, self.owner, time.time(), host=self.me["host"],
                                       pid_started_at_s=procs.holder_started_at(doc))
        if decision.action == "hold":
            self.held.setdefault(key, (decision.generation, time.time()))
        if decision.action != "create":
            return decision.action == "hold"
        now = time.time()
        try:
            created = self.store.put_json(layout.lease_key(key, decision.generation),
                                          leases.new_lease(self.owner, now, self.ttl_s, self.me))
        except IntegrityError:
            return False  # another contender created that generation first
        if created and latest is not None:
            log.warning("took over the compile lease of %s from %s: %s", key, describe(doc), decision.why)
        if created:
            self.held[key] = (decision.generation, now)
        return created

    def renew_due(self) -> None:
        """Rewrite, with a later expiry, every held lease a third of its TTL old."""
        for key, (generation, renewed_at) in list(self.held.items()):
            now = time.time()
            if not leases.renewal_due(renewed_at, now, self.ttl_s):
                continue
            try:
                self.store.put_json(layout.lease_key(key, generation),
                                    leases.new_lease(self.owner, now, self.ttl_s, self.me), overwrite=True)
            except Exception as exc:  # tried again at the next tick; the TTL outlasts two misses
                log.warning("could not renew the compile lease of %s: %s", key, exc)
                continue
            self.held[key] = (generation, now)

    def release(self, key: str) -> None:
        self.held.pop(key, None)
        for obj in self.store.list(layout.lease_prefix(key)):
            self.store.delete(obj)


def compile_leased(pool: CompilePool, leases: Leases, store, jobs: list[tuple[dict, str]],
                   upload: Callable[[CompileResult], None], *, poll_s: float = 2.0) -> set[str]:
    """Compile in `pool` each job whose key is not stored, each under its lease; returns the keys waited for.

    A key is leased when its compile is submitted to a worker (`upload` must release it) and its lease
    is renewed while it compiles; a key another export holds is skipped, then tried again every `poll_s`
    until it is stored (reused) or its lease is taken over. On an error every held lease is released
    at once, not left to its TTL.
    """
    waited: set[str] = set()

    def submit(spec: dict) -> bool:
        if store.exists(artifact_key(spec["key"])):
            return False
        if not leases.acquire(spec["key"]):
            waited.add(spec["key"])
            return False
        if store.exists(artifact_key(spec["key"])):  # stored between the first look and the lease: reuse it
            leases.release(spec["key"])
            return False
        return True

    waiting = list(jobs)
    try:
        while waiting:
            done = {r.key for r in pool.run(waiting, upload, on_submit=submit, on_tick=leases.renew_due,
                                            tick_s=leases.ttl_s / 6)}
            waiting = [j for j in waiting if j[0]["key"] not in done and not store.exists(artifact_key(j[0]["key"]))]
            if waiting:
                time.sleep(poll_s)  # another export holds these keys: wait for its uploads or its lease to go
    except BaseException:
        for key in list(leases.held):
            leases.release(key)
        raise
    return waited
