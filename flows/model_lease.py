"""One export per model at a time: a Prefect global concurrency limit per model, enqueueing.

Purpose: two runs of the same model (two schedules, a schedule and a UI click,
a retry and a manual re-run) must not compile the same forward keys at once.
Each try of the export flow holds a slot of the global concurrency limit
`kiln-model-<name>` (created with limit 1 the first time) from its probe to its
manifest. A second run waits for the slot (it is enqueued, not cancelled), then
probes the store and compiles only what the first one did not store.

Contracts: the slot is a lease that the holder's process renews (Prefect's
lease, and the holder record below). The holder records itself in the variable
`<lease>-holder`: flow run, export, host, pid, process start time, Prefect's
lease id and an expiry it pushes forward every quarter of the lease (the
recipe's model_lease_s, LEASE_S by default). A waiting run
checks that record every POLL_S; a holder that is provably gone
(kiln.core.holders: its process on this host is dead, or its record past
expiry) is taken over at once, logged naming the dead holder. Its slot is
freed through Prefect's API: by its lease id on a Prefect server; by name on
the embedded API, where a lease lives in the memory of the process that took
it and dies with it (nothing else would ever free that slot). Takeovers,
acquisitions and records are serialized per host by a file lock in
PREFECT_HOME, so two waiters never free one slot twice. The limit lives on the
Prefect server: runs that talk to different servers (or each to its own
embedded API on a different PREFECT_HOME) do not see each other's leases. An
operator may raise the limit (concurrent exports of one model, accepting
duplicate compiles) or set it inactive in the UI's Concurrency page to stop
enforcing it.
"""

from __future__ import annotations

import datetime as dt
import fcntl
import re
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from uuid import UUID

import httpx
from prefect import get_run_logger
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency.asyncio import ConcurrencySlotAcquisitionError
from prefect.concurrency.context import ConcurrencyContext
from prefect.concurrency.sync import concurrency
from prefect.context import FlowRunContext
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
from prefect.settings import PREFECT_API_URL, get_current_settings
from prefect.variables import Variable

from flows.embedded_api import is_embedded
from flows.params import ExportParams, model_name
from kiln.core.holders import describe, holder_gone, holder_record
from kiln.core.recipe import Recipe
from kiln.host import procs

LEASE_S = Recipe().model_lease_s
"""Lease of the slot by default (the recipe's model_lease_s); Prefect renews it every 0.75 x the lease while
the export runs, and the holder record's expiry (a lease ahead) is pushed forward every quarter of it."""
POLL_S = 3.0
"""A waiting run tries the slot, and judges its holder, this often."""
_MEMORY_LEASES = "prefect.server.concurrency.lease_storage.memory"


def lease_name(model: str) -> str:
    """The global concurrency limit of one model: 'kiln-model-' + a slug of its name."""
    slug = re.sub(r"[^a-z0-9._-]+", "-", model.lower()).strip("-.") or "model"
    return f"kiln-model-{slug}"[:120]


def ensure_limit(name: str, limit: int = 1) -> None:
    """Create the global concurrency limit `name` unless it exists (an operator's changes are kept)."""
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
            return
        except ObjectNotFound:
            pass
        try:
            client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=limit))
        except ObjectAlreadyExists:  # another run created it first
            pass


def holder_variable(name: str) -> str:
    """The Prefect variable that names who holds lease `name` (the Concurrency page does not say)."""
    return f"{name.replace('.', '_')}-holder"[:255]


def _holder_if_taken(name: str) -> dict | None:
    """Who holds the slot, when it is taken now (best effort: None when unknown)."""
    try:
        with get_client(sync_client=True) as client:
            if client.read_global_concurrency_limit_by_name(name).active_slots < 1:
                return None
        return Variable.get(holder_variable(name), default=None) or {}
    except Exception:
        return None


def _who(holder: dict) -> str:
    if not holder:
        return "another export"
    who = (f"flow run {holder.get('flow_run_name')} ({holder.get('flow_run_id')}), export "
           f"{holder.get('export_id')}, since {holder.get('since')}")
    return who + (f", process {holder['pid']} on {holder.get('host')}" if holder.get("pid") else "")


@contextmanager
def _host_lock(name: str) -> Iterator[None]:
    """Serialize takeovers, acquisitions and holder records of lease `name` among this host's runs."""
    path = Path(get_current_settings().home) / "kiln-locks" / f"{name}.lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _take_over(name: str, holder: dict, why: str, log, lease_s: float) -> bool:
    """Free the slot of `holder`, provably gone, through Prefect's API; False when it cannot be freed now."""
    embedded = (is_embedded(PREFECT_API_URL.value())
                and get_current_settings().server.concurrency.lease_storage == _MEMORY_LEASES)
    with get_client(sync_client=True) as client:
        if embedded:  # its lease died with its process's memory: only the slot count is left to free
            client.release_concurrency_slots([name], slots=1, occupancy_seconds=lease_s)
        elif holder.get("lease_id"):  # the server frees the slot and revokes the lease (its expiry frees nothing more)
            client.release_concurrency_slots_with_lease(UUID(holder["lease_id"]))
        else:
            log.warning("the holder of the model lease %s is gone (%s: %s) but did not record its Prefect lease; "
                        "waiting for the server to expire it", name, describe(holder), why)
            return False
    log.warning("took over the model lease %s from %s: %s", name, describe(holder), why)
    return True


def _try_acquire(stack: ExitStack, name: str, lease_s: float) -> str | None | bool:
    """Take the slot now if it is free (entered on `stack`): its Prefect lease id (None when unknown), or
    False when the slot is taken."""
    ctx = ConcurrencyContext.get()
    before = set(ctx.cleanup_lease_ids) if ctx else set()
    try:
        stack.enter_context(concurrency(name, occupy=1, strict=True, lease_duration=lease_s, max_retries=0))
    except ConcurrencySlotAcquisitionError as exc:
        cause = exc.__cause__
        if isinstance(cause, httpx.HTTPStatusError) and cause.response.status_code == 423:
            return False  # taken
        raise
    new = [lease for lease in (ctx.cleanup_lease_ids if ctx else []) if lease not in before]
    return str(new[-1]) if new else None  # Prefect lists a lease there the moment it is granted


def _record(name: str, record: dict, log) -> None:
    try:
        Variable.set(holder_variable(name), record, overwrite=True)
    except Exception as exc:  # a missed write is renewed next time; the lease outlasts three misses
        log.warning("could not record the holder of the model lease %s: %s", name, exc)


@contextmanager
def _renewing(name: str, record: dict, log, lease_s: float) -> Iterator[None]:
    """Push the holder record's expiry (a lease ahead) forward every quarter of the lease while the block runs."""
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(lease_s / 4):
            _record(name, {**record, "expires_at": time.time() + lease_s}, log)

    thread = threading.Thread(target=loop, name=f"{name}-holder-renewal", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(timeout=10)


@contextmanager
def model_lease(params: ExportParams, lease_s: float = LEASE_S) -> Iterator[str]:
    """Hold the model's slot for the duration of the block; waits while another export holds it, saying
    for what and whom, and takes it over at once from a holder that is provably gone. The variable
    `<lease>-holder` names the flow run, export and process that took the slot last (the holder while
    the slot is taken)."""
    log = get_run_logger()
    name = lease_name(model_name(params))
    ensure_limit(name)
    start = time.monotonic()
    ctx = FlowRunContext.get()
    run = ctx.flow_run if ctx else None
    me = {"flow_run_id": str(run.id) if run else None, "flow_run_name": run.name if run else None,
          "export_id": params.export_id}
    proc = procs.this_process()
    announced = False
    with ExitStack() as stack:
        while True:
            with _host_lock(name):
                holder = _holder_if_taken(name)
                why = holder and holder_gone(holder, host=proc["host"], now_s=time.time(),
                                             pid_started_at_s=procs.holder_started_at(holder))
                if why:
                    try:
                        _take_over(name, holder, why, log, lease_s)
                    except Exception as exc:  # tried again at the next poll
                        log.warning("could not take over the model lease %s from %s: %s", name, describe(holder), exc)
                elif holder is None and not announced:
                    log.info("taking the model lease %s (one export per model at a time)", name)
                    announced = True
                lease_id = _try_acquire(stack, name, lease_s)
                if lease_id is not False:
                    now = time.time()
                    record = {**me, "since": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
                              "lease_id": lease_id,
                              **holder_record(proc["host"], proc["pid"], proc["started_at"], now, lease_s)}
                    _record(name, record, log)
                    break
            if not announced:
                log.warning("waiting for the model lease %s (one export per model at a time): held by %s",
                            name, _who(holder or {}))
                announced = True
            time.sleep(POLL_S)
        log.info("took the model lease %s after %.1f s", name, time.monotonic() - start)
        # The record stays after release: a waiting run reads it only while the slot is taken (and then by
        # the holder that overwrote it), so deleting it would buy nothing. It would cost: Prefect deletes a
        # variable by reading it first in a deferred SQLite transaction, which fails at once with "database
        # is locked" (HTTP 503, retried after ~2 s) when the event persister wrote in between.
        stack.enter_context(_renewing(name, record, log, lease_s))
        yield name
