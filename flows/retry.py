"""Flow retries that follow the run's recipe and never repeat a deterministic failure.

Purpose: Prefect 3.9.1 has `retries` and `retry_delay_seconds` on flows but no
flow-level `retry_condition_fn`. The server decides whether a failed flow run
is tried again from the run's own policy (`empirical_policy.retries` against
`run_count`), so `resumable` sets that policy from the run's recipe when each
try starts and sets it to 0 when a try fails with an error that would fail the
same way again (kiln.core.run.retry_rule.worth_retrying: only what can heal is retried): a gate refusal among them,
unless the recipe's `retry_refusals` says the deployment waits for memory. A transient error that a lower
level retried already (a store error after the store's per-request retries, an error an I/O task retried) is
not retried here a second time: each failure is retried at one level (kiln.core.run.retry_rule's docstring).

Contracts: the decorator's `retries`/`retry_delay_seconds` are only the
defaults until the first try reads the recipe. A try that fails before the
recipe is read (bad settings) is not retried either. A Kiln error that no try
follows ends the run in a Failed state whose message is the error itself, then
why it is not retried (`final_state`; said once in the log, as a warning). The export id is fixed
per flow run, so every try writes the same export and its Prefect artifacts
gain versions instead of multiplying.

Pitfalls: a retry re-runs the whole flow body in the same process; the probe
runs again (a fresh view of memory and of the store), so only forwards missing
from the store are compiled.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterator
from contextlib import contextmanager

from prefect import get_run_logger
from prefect.client.orchestration import get_client
from prefect.context import FlowRunContext
from prefect.states import Failed

from flows.logs import said, said_already
from flows.params import ExportParams, build_recipe, default_export_id
from kiln.core.errors import GateRefused, KilnError
from kiln.core.plan.recipe import SETTING, Recipe, where_to_set
from kiln.core.run.run_page import state_message
from kiln.core.run.retry_rule import transient, worth_retrying


def _set_policy(flow_run_id, *, retries: int, delay_s: float | None = None) -> None:
    with get_client(sync_client=True) as client:
        policy = client.read_flow_run(flow_run_id).empirical_policy
        policy.retries = retries
        if delay_s is not None:
            policy.retry_delay = int(round(delay_s))
        client.update_flow_run(flow_run_id, empirical_policy=policy)


@contextmanager
def resumable(params: ExportParams) -> Iterator[tuple[ExportParams, Recipe]]:
    """Around one try of the export flow: yields `params` with the run's fixed export id, and the try's
    recipe (built here, once per try: the recipe block is read once)."""
    ctx = FlowRunContext.get()
    run = ctx.flow_run if ctx else None
    if run is None:  # not inside a flow run: nothing to orchestrate
        yield params, build_recipe(params)
        return
    log = get_run_logger()
    recipe = None
    try:
        recipe = build_recipe(params)
        _set_policy(run.id, retries=recipe.flow_retries, delay_s=recipe.flow_retry_delay_s)
        if not params.export_id:
            when = run.expected_start_time or run.start_time or dt.datetime.now(dt.timezone.utc)
            params = params.model_copy(update={"export_id": default_export_id(params, when, run.id.hex[:4])})
        if run.run_count > 1:  # a warning: the console shows it by default (kiln export without --verbose)
            log.warning("try %d of %d: resuming export %s; forwards already in the store are reused",
                        run.run_count, recipe.flow_retries + 1, params.export_id)
        yield params, recipe
    except Exception as exc:
        attempt, tries = run.run_count, (recipe or Recipe()).flow_retries + 1
        why = why_final(exc, retry_refusals=recipe is not None and recipe.retry_refusals, attempt=attempt,
                        tries=tries)
        if why is not None:
            if not worth_retrying(exc, retry_refusals=recipe is not None and recipe.retry_refusals):
                _set_policy(run.id, retries=0)
            if isinstance(exc, KilnError) and not said_already(str(exc)):
                log.error("%s", exc)  # the error itself, once (the gate says its refusal as it decides)
            elif not isinstance(exc, KilnError):
                why = f"{why} ({type(exc).__name__}: {exc})"
            log.warning("%s", why)
            setattr(exc, FINAL_WHY, why)
        raise


FINAL_WHY = "kiln_final_why"
"""The attribute that `resumable` sets on an error that ends its flow run: why no try follows (on the
error itself, so a later error is never taken for an earlier one)."""


def why_final(exc: BaseException, *, retry_refusals: bool, attempt: int, tries: int) -> str | None:
    """Why a try that failed with `exc` is the run's last ('not retried: ...'), or None when a try follows."""
    if not worth_retrying(exc, retry_refusals=retry_refusals):
        if isinstance(exc, GateRefused):
            return f"not retried: a refusal is final (to wait for memory instead, {where_to_set('retry_refusals', True)})"
        if transient(exc):
            return f"not retried: {type(exc).__name__} was retried where it happened, within its budget"
        return f"not retried: {type(exc).__name__} fails the same way every time"
    if attempt >= tries:
        return (f"not retried: this was try {attempt} of {tries} (Recipe > "
                f"'{SETTING['flow_retries'].title}' is {tries - 1})")
    return None


def final_state(exc: BaseException):
    """The flow run's Failed state for a KilnError that ends it (`resumable` found no try follows): its
    message is the error itself, then why it is not retried; None for an error Prefect should see raised
    (a try follows, or not a KilnError). The state carries the error: a caller in this process gets it
    raised (`kiln export`'s exit codes)."""
    why = exc.__dict__.pop(FINAL_WHY, None)
    if why is None or not isinstance(exc, KilnError):
        return None
    message = state_message(exc, why)
    said(message)  # Prefect's "Finished in state Failed(...)" line refers to it
    return Failed(message=message, data=exc)
