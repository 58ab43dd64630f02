"""Compile leases in the store, per key among the exports of one signer (a scope): taken when a key's compile
is submitted, renewed while it compiles.

The I/O side of kiln.core.run.leases (the decisions) and kiln.core.run.holders (is a
holder provably gone). `compile_leased` drives a CompilePool under these
leases; `kiln.host.phases.host_compile.compile_on_host` calls it on each host.
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from kiln.core.trust import layout
from kiln.core.run import leases
from kiln.core.errors import IntegrityError, KilnError
from kiln.core.run.holders import describe
from kiln.host.processes import procs
from kiln.host.compile.compiler import CompilePool, CompileResult
from kiln.store import ObjectMissing

log = logging.getLogger(__name__)


class LeaseWaitExpired(KilnError):
    """Keys another export holds stayed leased, none of them stored, for longer than the recipe's lease_wait_s."""


class Leases:
    """Compile leases of one host in one export (see kiln.core.run.leases): taken per key when its compile
    is submitted, renewed every third of `ttl_s` while it compiles (`renew_due`), released on upload.

    A held lease is checked before each renewal: once another export has taken it over (created the
    next generation) or it is gone (broken by the orchestrator), this host stops holding it.
    """

    def __init__(self, store, owner: str, ttl_s: float, *, scope: str):
        self.store, self.owner, self.ttl_s, self.scope = store, owner, ttl_s, scope
        self.me = procs.this_process()
        self.held: dict[str, tuple[int, float]] = {}
        """key -> (generation, when it was last written) of each lease held now."""

    def latest(self, key: str) -> tuple[int, dict] | None:
        """(generation, document) of the newest lease of `key`, if any; an unreadable document reads as {}."""
        found = layout.lease_generations(key, self.scope, self.store.list(layout.lease_prefix(key, self.scope)))
        if not found:
            return None
        generation = max(found)
        return generation, self._read(found[generation]) or {}

    def _read(self, obj: str) -> dict | None:
        """The lease document at `obj`; None when there is none, {} when it is unreadable."""
        try:
            doc = self.store.get_json(obj)
        except ObjectMissing:
            return None
        except IntegrityError:
            return {}
        return doc if isinstance(doc, dict) else {}

    def acquire(self, key: str) -> bool:
        latest = self.latest(key)
        doc = latest[1] if latest else {}
        decision = leases.decide_lease(latest, self.owner, time.time(), host=self.me["host"],
                                       pid_started_at_s=procs.holder_started_at(doc))
        if decision.action == "hold":
            self.held.setdefault(key, (decision.generation, time.time()))
        if decision.action != "create":
            return decision.action == "hold"
        now = time.time()
        try:
            created = self.store.put_json(layout.lease_key(key, self.scope, decision.generation),
                                          leases.new_lease(self.owner, now, self.ttl_s, self.me))
        except IntegrityError:
            return False  # another contender created that generation first
        if created and latest is not None:
            log.warning("took over the compile lease of %s from %s: %s", key, describe(doc), decision.why)
        if created:
            self.held[key] = (decision.generation, now)
        return created

    def lost_to(self, key: str, generation: int) -> dict | None:
        """None while generation `generation` of `key` is ours and the newest; else the lease that replaced
        it ({} when it was deleted, e.g. broken by the orchestrator)."""
        newer = self._read(layout.lease_key(key, self.scope, generation + 1))
        if newer is not None:
            return newer  # taken over: only a contender that judged ours gone creates the next generation
        doc = self._read(layout.lease_key(key, self.scope, generation))
        return None if doc is not None and doc.get("owner") == self.owner else (doc or {})

    def renew_due(self) -> None:
        """Rewrite, with a later expiry, every held lease a third of its TTL old that is still ours."""
        for key, (generation, renewed_at) in list(self.held.items()):
            now = time.time()
            if not leases.renewal_due(renewed_at, now, self.ttl_s):
                continue
            try:
                lost = self.lost_to(key, generation)
                if lost is None:
                    self.store.put_json(layout.lease_key(key, self.scope, generation),
                                        leases.new_lease(self.owner, now, self.ttl_s, self.me), overwrite=True)
            except Exception as exc:  # tried again at the next tick; the TTL outlasts two misses
                log.warning("could not renew the compile lease of %s: %s", key, exc)
                continue
            if lost is not None:
                self.held.pop(key, None)
                log.warning("the compile lease of %s is no longer ours (%s): not renewing it; another export "
                            "may compile that key too", key,
                            f"taken over by {describe(lost)}" if lost else "it was deleted")
                continue
            self.held[key] = (generation, now)

    def release(self, key: str) -> None:
        """Delete the lease this host holds on `key` if it still names us, and the older generations it
        replaced; a contender's newer generation is left alone."""
        held = self.held.pop(key, None)
        if held is None:
            return
        generation = held[0]
        doc = self._read(layout.lease_key(key, self.scope, generation))
        if doc is None or doc.get("owner") != self.owner:
            return
        found = layout.lease_generations(key, self.scope, self.store.list(layout.lease_prefix(key, self.scope)))
        for g in sorted(found):
            if g < generation:
                self.store.delete(found[g])  # superseded: their holders were gone when they were taken over
        self.store.delete(layout.lease_key(key, self.scope, generation))


def compile_leased(pool: CompilePool, ours: Leases, jobs: list[tuple[dict, str]],
                   upload: Callable[[CompileResult], None], *, stored: Callable[[str], bool], poll_s: float = 2.0,
                   wait_s: float = 3 * 3600.0) -> set[str]:
    """Compile in `pool` each job whose key is not stored (`stored(key)`: the store holds a package of it
    this export may load), each under its lease in `ours` (this host's); returns the keys waited for.

    A key is leased when its compile is submitted to a worker (`upload` must release it) and its lease
    is renewed while it compiles; a key another export holds is skipped, then tried again every `poll_s`
    until it is stored (reused) or its lease is taken over. When `wait_s` seconds pass with keys still
    waited for and none of them stored or compiled here meanwhile, LeaseWaitExpired names them and their
    holder. On an error the pool's workers are stopped, then every held lease is released at once (not
    left to its TTL): no key is released while a worker here still compiles it.
    """
    waited: set[str] = set()

    def submit(spec: dict) -> bool:
        if stored(spec["key"]):
            return False
        if not ours.acquire(spec["key"]):
            waited.add(spec["key"])
            return False
        if stored(spec["key"]):  # stored between the first look and the lease: reuse it
            ours.release(spec["key"])
            return False
        return True

    waiting = list(jobs)
    moved_at = time.monotonic()
    try:
        while waiting:
            done = {r.key for r in pool.run(waiting, upload, on_submit=submit, on_tick=ours.renew_due,
                                            tick_s=ours.ttl_s / 6)}
            left = [j for j in waiting if j[0]["key"] not in done and not stored(j[0]["key"])]
            if len(left) < len(waiting):
                moved_at = time.monotonic()
            waiting = left
            if waiting and time.monotonic() - moved_at > wait_s:
                raise _wait_expired(ours, [j[0]["key"] for j in waiting], wait_s)
            if waiting:
                time.sleep(poll_s)  # another export holds these keys: wait for its uploads or its lease to go
    except BaseException:
        pool.stop()  # a worker still compiling a key must not outlive its lease
        for key in list(ours.held):
            try:
                ours.release(key)
            except Exception as exc:  # the error that brought us here is the one to report
                log.warning("could not release the compile lease of %s (it expires after lease_ttl_s): %s", key, exc)
        raise
    return waited


def _wait_expired(ours: Leases, keys: list[str], wait_s: float) -> LeaseWaitExpired:
    latest = ours.latest(keys[0])
    holder = describe(latest[1]) if latest and latest[1] else "a holder whose lease is gone now"
    more = f" and {len(keys) - 1} more" if len(keys) > 1 else ""
    return LeaseWaitExpired(
        f"waited {wait_s:.0f} s for forward {keys[0]}{more}, leased by another export ({holder}), without any "
        "of them being stored meanwhile; see whether that export still makes progress (cancel it if it hangs), "
        "or raise the recipe's lease_wait_s.")
