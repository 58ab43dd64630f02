"""One export per model at a time: a Prefect global concurrency limit per model, enqueueing.

Purpose: two runs of the same model (two schedules, a schedule and a UI click,
a retry and a manual re-run) must not compile the same forward keys at once.
Each try of the export flow holds a slot of the global concurrency limit
`kiln-model-<name>` (created with limit 1 the first time) from its probe to its
manifest. A second run waits for the slot (it is enqueued, not cancelled), then
probes the store and compiles only what the first one did not store.

Contracts: the slot is a lease that the holder's process renews; a process
that dies frees it when the lease expires (`LEASE_S`). The limit lives on the
Prefect server: runs that talk to different servers (or each to its own
embedded API) do not see each other's leases. An operator may raise the limit
(concurrent exports of one model, accepting duplicate compiles) or set it
inactive in the UI's Concurrency page to stop enforcing it.
"""

from __future__ import annotations

import datetime as dt
import re
import time
from collections.abc import Iterator
from contextlib import contextmanager

from prefect import get_run_logger
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency.sync import concurrency
from prefect.context import FlowRunContext
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
from prefect.variables import Variable

from flows.params import ExportParams, model_name

LEASE_S = 120.0
"""Lease of the slot; renewed every 0.75 * LEASE_S while the export runs."""


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


@contextmanager
def model_lease(params: ExportParams) -> Iterator[str]:
    """Hold the model's slot for the duration of the block; waits while another export holds it, saying
    for what and whom. The variable `<lease>-holder` names the flow run and export that took the slot last
    (the holder while the slot is taken)."""
    log = get_run_logger()
    name = lease_name(model_name(params))
    ensure_limit(name)
    start = time.monotonic()
    holder = _holder_if_taken(name)
    if holder is not None:
        who = (f"flow run {holder.get('flow_run_name')} ({holder.get('flow_run_id')}), export "
               f"{holder.get('export_id')}, since {holder.get('since')}") if holder else "another export"
        log.warning("waiting for the model lease %s (one export per model at a time): held by %s", name, who)
    else:
        log.info("taking the model lease %s (one export per model at a time)", name)
    with concurrency(name, occupy=1, strict=True, lease_duration=LEASE_S):
        waited_s = time.monotonic() - start
        log.info("took the model lease %s after %.1f s", name, waited_s)
        ctx = FlowRunContext.get()
        run = ctx.flow_run if ctx else None
        try:
            Variable.set(holder_variable(name), {
                "flow_run_id": str(run.id) if run else None, "flow_run_name": run.name if run else None,
                "export_id": params.export_id, "since": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")},
                overwrite=True)
        except Exception as exc:  # who holds it is a courtesy to whoever waits
            log.debug("could not record the lease holder: %s", exc)
        # The record stays after release: a waiting run reads it only while the slot is taken (and then by
        # the holder that overwrote it), so deleting it would buy nothing. It would cost: Prefect deletes a
        # variable by reading it first in a deferred SQLite transaction, which fails at once with "database
        # is locked" (HTTP 503, retried after ~2 s) when the event persister wrote in between.
        yield name
