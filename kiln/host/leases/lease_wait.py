"""Holding a lease that other processes want: wait, take over from a gone holder, keep the record fresh.

`hold(server, me, lease_s)` holds the one slot of a `SlotServer` for the
duration of a block. Until it gets the slot it tries every `poll_s`; at each
try, under the server's host lock, it judges the holder's record
(kiln.core.run.holders): a holder provably gone (its process on this host is dead,
or its record past expiry) has its slot freed at once, and the try follows.
Once it holds the slot it writes its own record, and a thread pushes the
record's expiry a lease ahead every quarter of the lease until the block ends,
or until `overdue()` says the holder is stuck past a deadline: then the record
is left to expire (within `lease_s`), and a waiting run judges the holder gone
and takes the slot over. So a holder that hangs keeps the slot at most
`lease_s` past its deadline; one without deadlines, as long as it lives.
Nothing here knows Prefect: flows/model_lease.py is the server (a global
concurrency limit per model, the record in a Prefect variable).

Contracts: what the waiting run says is logged through `log` (a logger): one
line when it takes a free slot, one when it starts waiting (naming the
holder), one per takeover. A takeover that fails is tried again at the next
poll. A record that cannot be written is renewed next time (the lease
outlasts three misses).
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Protocol

from kiln.core.run.holders import describe, holder_gone, holder_record
from kiln.host.processes import procs


class SlotServer(Protocol):
    """The one slot of a named lease, as the server that keeps it offers it."""

    name: str

    def host_lock(self) -> AbstractContextManager:
        """Serialize takeovers, acquisitions and records of this lease among this host's processes."""

    def holder_if_taken(self) -> dict | None:
        """The holder's record when the slot is taken now ({} when taken with no record), else None."""

    def free(self, holder: dict, why: str) -> bool:
        """Free the slot of `holder`, provably gone (`why`); False when it cannot be freed now."""

    def try_take(self) -> str | None | bool:
        """Take the slot now if it is free: the server's lease id (None when unknown), or False when taken."""

    def release(self) -> None:
        """Give the slot back (the end of the block that holds it)."""

    def record(self, record: dict) -> None:
        """Write the holder's record (raises when it cannot)."""


@contextmanager
def hold(server: SlotServer, me: dict, lease_s: float, log, *, poll_s: float,
         overdue: Callable[[], str | None] | None = None) -> Iterator[dict]:
    """Hold the server's slot for the block, waiting while another holds it and taking it over at once from
    a holder provably gone; yields the record written (`me` + since, lease id, process and expiry). The
    record is renewed until the block ends or `overdue()` returns what is past its deadline."""
    start = time.monotonic()
    proc = procs.this_process()
    announced = False
    try:
        while True:
            with server.host_lock():
                holder = server.holder_if_taken()
                if holder is None and not announced:
                    log.info("taking the model lease %s (one export per model at a time)", server.name)
                    announced = True
                elif holder is not None:
                    _free_if_gone(server, holder, proc, log)
                lease_id = server.try_take()
                if lease_id is not False:
                    record = {**me, "since": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                              "lease_id": lease_id,
                              **holder_record(proc["host"], proc["pid"], proc["started_at"], time.time(), lease_s)}
                    _record(server, record, log)
                    break
            if not announced:
                log.warning("waiting for the model lease %s (one export per model at a time): held by %s",
                            server.name, describe(holder or {}))
                announced = True
            time.sleep(poll_s)
        log.info("took the model lease %s after %.1f s", server.name, time.monotonic() - start)
        with _renewing(server, record, log, lease_s, overdue):
            yield record
    finally:  # also when the wait ends by an error: a slot taken is never kept
        server.release()


def _free_if_gone(server: SlotServer, holder: dict, proc: dict, log) -> None:
    """Free the slot of `holder` when it is provably gone (kiln.core.run.holders), saying so; a failure to free it
    is said too, and the next poll tries again."""
    why = holder_gone(holder, host=proc["host"], now_s=time.time(), pid_started_at_s=procs.holder_started_at(holder))
    if not why:
        return
    try:
        if server.free(holder, why):
            log.warning("took over the model lease %s from %s: %s", server.name, describe(holder), why)
        else:
            log.warning("the holder of the model lease %s is gone (%s: %s) but did not record its lease; waiting "
                        "for the server to expire it", server.name, describe(holder), why)
    except Exception as exc:
        log.warning("could not take over the model lease %s from %s: %s", server.name, describe(holder), exc)


def _record(server: SlotServer, record: dict, log) -> None:
    try:
        server.record(record)
    except Exception as exc:  # a missed write is renewed next time; the lease outlasts three misses
        log.warning("could not record the holder of the model lease %s: %s", server.name, exc)


@contextmanager
def _renewing(server: SlotServer, record: dict, log, lease_s: float,
              overdue: Callable[[], str | None] | None = None) -> Iterator[None]:
    """Push the holder record's expiry (a lease ahead) forward every quarter of the lease while the block runs,
    until `overdue()` says the holder is stuck past a deadline (said once, as an error)."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(lease_s / 4):
            why = overdue() if overdue is not None else None
            if why:
                log.error("%s: no longer renewing the model lease %s; its holder record expires within %.0f s "
                          "and a waiting export may then take the model over", why, server.name, lease_s)
                return
            _record(server, {**record, "expires_at": time.time() + lease_s}, log)

    thread = threading.Thread(target=loop, name=f"{server.name}-holder-renewal", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)
