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
recipe's model_lease_s, LEASE_S by default) until the export is stuck past a
phase's deadline (kiln.core.plan.deadlines; the record then expires and a
waiting run takes the slot over). A waiting run
checks that record every POLL_S; a holder that is provably gone
(kiln.core.run.holders: its process on this host is dead, or its record past
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

The waiting, the takeovers and the renewal are kiln.host.leases.lease_wait's, which
knows no Prefect; this module is Prefect's side of them (`PrefectSlot`).
"""

from __future__ import annotations

import fcntl
import re
from collections.abc import Callable, Iterator
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
from kiln.core.plan.recipe import Recipe
from kiln.host.leases.lease_wait import hold

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


class PrefectSlot:
    """The model lease's slot on Prefect (kiln.host.leases.lease_wait.SlotServer): the global concurrency limit
    `name`, its holder record in a Prefect variable, the host lock in PREFECT_HOME."""

    def __init__(self, name: str, lease_s: float):
        self.name, self.lease_s = name, lease_s
        self._held = ExitStack()

    @contextmanager
    def host_lock(self) -> Iterator[None]:
        path = Path(get_current_settings().home) / "kiln-locks" / f"{self.name}.lock"
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "a") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def holder_if_taken(self) -> dict | None:
        """Who holds the slot, when it is taken now (best effort: None when unknown)."""
        try:
            with get_client(sync_client=True) as client:
                if client.read_global_concurrency_limit_by_name(self.name).active_slots < 1:
                    return None
            return Variable.get(holder_variable(self.name), default=None) or {}
        except Exception:
            return None

    def free(self, holder: dict, why: str) -> bool:
        """Free the slot through Prefect's API: by name on the embedded API, whose leases died with the
        holder's memory (only the slot count is left to free); by the holder's lease id on a server, which
        also revokes the lease. False when the holder recorded no lease id (the server's expiry frees it)."""
        embedded = (is_embedded(PREFECT_API_URL.value())
                    and get_current_settings().server.concurrency.lease_storage == _MEMORY_LEASES)
        with get_client(sync_client=True) as client:
            if embedded:
                client.release_concurrency_slots([self.name], slots=1, occupancy_seconds=self.lease_s)
            elif holder.get("lease_id"):
                client.release_concurrency_slots_with_lease(UUID(holder["lease_id"]))
            else:
                return False
        return True

    def try_take(self) -> str | None | bool:
        """Take the slot now if it is free (held until `release`): its Prefect lease id (None when unknown),
        or False when the slot is taken."""
        ctx = ConcurrencyContext.get()
        before = set(ctx.cleanup_lease_ids) if ctx else set()
        try:
            self._held.enter_context(concurrency(self.name, occupy=1, strict=True, lease_duration=self.lease_s,
                                                 max_retries=0))
        except ConcurrencySlotAcquisitionError as exc:
            cause = exc.__cause__
            if isinstance(cause, httpx.HTTPStatusError) and cause.response.status_code == 423:
                return False  # taken
            raise
        new = [lease for lease in (ctx.cleanup_lease_ids if ctx else []) if lease not in before]
        return str(new[-1]) if new else None  # Prefect lists a lease there the moment it is granted

    def release(self) -> None:
        # The record stays after release: a waiting run reads it only while the slot is taken (and then by
        # the holder that overwrote it), so deleting it would buy nothing. It would cost: Prefect deletes a
        # variable by reading it first in a deferred SQLite transaction, which fails at once with "database
        # is locked" (HTTP 503, retried after ~2 s) when the event persister wrote in between.
        self._held.close()

    def record(self, record: dict) -> None:
        Variable.set(holder_variable(self.name), record, overwrite=True)


@contextmanager
def model_lease(params: ExportParams, lease_s: float = LEASE_S,
                overdue: Callable[[], str | None] | None = None) -> Iterator[str]:
    """Hold the model's slot for the duration of the block (kiln.host.leases.lease_wait.hold); waits while another
    export holds it, saying for what and whom, and takes it over at once from a holder that is provably
    gone. The variable `<lease>-holder` names the flow run, export and process that took the slot last (the
    holder while the slot is taken). `overdue()` says what of the export is past its deadline (None while
    nothing is): from then on the holder record is no longer renewed."""
    name = lease_name(model_name(params))
    ensure_limit(name)
    ctx = FlowRunContext.get()
    run = ctx.flow_run if ctx else None
    me = {"flow_run_id": str(run.id) if run else None, "flow_run_name": run.name if run else None,
          "export_id": params.export_id}
    with hold(PrefectSlot(name, lease_s), me, lease_s, get_run_logger(), poll_s=POLL_S, overdue=overdue):
        yield name
