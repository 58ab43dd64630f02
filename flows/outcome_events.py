"""Kiln's Prefect events, emitted: an export try's outcome, and a checkpoint announced (`kiln announce`).

Purpose: automations react to exports without polling. The names, resources
and labels are kiln/core/run/events.py's; this module only sends them.

Contracts: an event goes to the Prefect server of PREFECT_API_URL (inside a
flow run, the run's; Prefect adds the flow run, flow and deployment as related
resources). Every try of the export flow emits exactly one outcome event, also
when it fails before its report exists (bad parameters, a missing checkpoint).
Emitting never fails an export: a lost event is logged. `announce` waits until
its event is sent, so `kiln announce` returns after delivery.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from prefect.events import emit_event

from kiln.core.run import events
from kiln.core.model.config import BUNDLED_MODEL
from kiln.core.errors import GateRefused, KilnError
from kiln.core.run.retry_rule import worth_retrying


@dataclass
class ExportOutcome:
    """What one try's outcome event says; the flow fills it in as it learns it."""

    parameters: dict
    """The flow run's parameters as given (all there is when they do not validate)."""
    params: object = None
    """ExportParams, with the run's export id, once known."""
    recipe: object = None
    """The try's Recipe, once built (it says whether a failure is retried)."""
    job: object = None
    report: object = None
    """The try's Report, once the job is prepared."""

    def event(self, error: BaseException | None) -> tuple[str, dict[str, str], dict]:
        """(name, resource, payload) of this try's outcome."""
        from prefect.context import FlowRunContext

        ctx = FlowRunContext.get()
        run = ctx.flow_run if ctx else None
        attempt = run.run_count if run else 1
        model = getattr(self.params, "model", None) or str(self.parameters.get("model", BUNDLED_MODEL))
        if self.job is not None and model != BUNDLED_MODEL:
            model = self.job.checkpoint  # absolute: `--model` takes it again from anywhere
        export_id = getattr(self.params, "export_id", None) or (f"flow-run-{run.id}" if run else "unnamed")
        final = error is None or self.recipe is None or attempt > self.recipe.flow_retries or \
            not worth_retrying(error, retry_refusals=self.recipe.retry_refusals)
        message = None if error is None else \
            (str(error) if isinstance(error, KilnError) else f"{type(error).__name__}: {error}")
        r = self.report
        name, resource, payload = events.export_event(
            export_id=export_id, model=model, tp=getattr(self.params, "tp", None) or self.parameters.get("tp", 2),
            status="completed" if error is None else "failed", attempt=attempt, final=final,
            store_url=self.job.store_url if self.job else "", manifest_key=r.manifest if r else None,
            short_hosts=error.short_hosts if isinstance(error, GateRefused) else None,
            counts=r.counts if r else None, error=message)
        if self.job is not None:
            resource["kiln.model-name"] = self.job.model_name
        return name, resource, payload


@contextmanager
def export_outcome(parameters: dict) -> Iterator[ExportOutcome]:
    """Around one try of the export flow: emits its `kiln.export.completed` or `kiln.export.failed` at the
    end (after the report and artifacts), then lets the try's error through."""
    outcome = ExportOutcome(parameters)
    try:
        yield outcome
    except BaseException as exc:
        _emit(outcome, exc)
        raise
    _emit(outcome, None)


def _emit(outcome: ExportOutcome, error: BaseException | None) -> None:
    from prefect.logging import get_logger

    try:
        name, resource, payload = outcome.event(error)
        emit_event(name, resource=resource, payload=payload)
    except Exception as exc:  # an event is a notice; the export's outcome stands without it
        get_logger("kiln.events").warning("could not emit the export's outcome event: %s", exc)


def announce(model: str, name: str, export_id: str | None = None, timeout_s: float = 30.0):
    """Emit `kiln.checkpoint.ready` for checkpoint `name` (exported with `--model model`); returns the event
    once sent. Raises RuntimeError when Prefect could not send it within `timeout_s`."""
    from prefect.events.worker import EventsWorker

    event = emit_event(events.CHECKPOINT_READY, resource=events.checkpoint_resource(model, name, export_id))
    if event is None:
        raise RuntimeError("Prefect emits no events here (no PREFECT_API_URL)")
    _, pending = EventsWorker.drain_all(timeout=timeout_s)
    if pending:
        raise RuntimeError(f"the event was not sent within {timeout_s:.0f} s")
    return event
