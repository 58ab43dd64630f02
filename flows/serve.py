"""`kiln serve`: the export flow as a Prefect deployment served from this process.

Purpose: schedules (cron or interval) and runs triggered from the Prefect UI or
API execute here, each in its own subprocess. The deployment's parameters are
the fields of flows.params.ExportParams, top-level (the recipe's settings typed
under `recipe`), whose schema the UI renders as the run form and the API
enforces. Its defaults are `{}`: a plain "Run" exports the tiny model to the
default store (KILN_HOME/store of the serving process).

With `--on-checkpoint` the deployment also has a trigger (an automation on the
server): each `kiln.checkpoint.ready` event (`kiln announce`) starts a run of
the model its resource's label `kiln.model` names (kiln/core/run/events.py).

Contracts: needs a Prefect server (PREFECT_API_URL); the embedded API would
vanish with this process. Runs of one model queue on the model's lease
(flows/model_lease.py). `infra/prefect.yaml` declares the same deployment for a
process work pool (`prefect deploy`).
"""

from __future__ import annotations

from prefect.deployments.runner import EntrypointType

from flows.params import ExportParams
from kiln.core.run import events
from kiln.core.errors import BadInput
from kiln.core.plan.recipe import form_overrides

DEPLOYMENT = "default"
"""Deployment name; the full name is 'kiln-export/default'."""


def deployment_parameters(params: ExportParams) -> dict:
    """Default parameters of the deployment: what differs from ExportParams' defaults, and the recipe
    settings that would override a recipe block's (kiln.core.plan.recipe.form_overrides: a flag given to
    `kiln serve` stays given in every run)."""
    out = params.model_dump(mode="json", exclude_defaults=True, exclude={"recipe"})
    return {**out, "recipe": overrides} if (overrides := form_overrides(params.recipe)) else out


def checkpoint_trigger(deployment: str = DEPLOYMENT):
    """The deployment trigger of `--on-checkpoint`: each `kiln.checkpoint.ready` event (resource
    `kiln.checkpoint.*`) starts a run whose `model` (and export id, when the event names one) comes from
    the event's labels; every other parameter is the deployment's default."""
    from prefect.events import DeploymentEventTrigger

    return DeploymentEventTrigger(
        name=f"kiln-export/{deployment}: export announced checkpoints",
        description=f"Run kiln-export/{deployment} for each {events.CHECKPOINT_READY} event (kiln announce).",
        expect={events.CHECKPOINT_READY}, match={"prefect.resource.id": f"{events.CHECKPOINT_PREFIX}*"},
        parameters=events.trigger_parameters())


def serve(params: ExportParams, *, name: str = DEPLOYMENT, cron: str | None = None,
          interval_s: float | None = None, limit: int | None = None, on_checkpoint: bool = False) -> None:
    """Create (or update) the deployment and run its flow runs until interrupted; with `on_checkpoint`, its
    trigger runs an export for each announced checkpoint."""
    from prefect.settings import PREFECT_API_URL

    from flows.export import export

    if cron is not None and interval_s is not None:
        raise BadInput("give --cron or --interval, not both.")
    if interval_s is not None and interval_s <= 0:
        raise BadInput(f"--interval {interval_s}: seconds must be > 0.")
    if not PREFECT_API_URL.value():
        raise BadInput("kiln serve needs a Prefect server: start one (prefect server start) and set "
                       "PREFECT_API_URL, e.g. http://127.0.0.1:4200/api.")
    if cron is not None:
        _check_cron(cron)
    export.serve(name=name, cron=cron, interval=interval_s, limit=limit,
                 parameters=deployment_parameters(params), tags=["kiln"],
                 triggers=[checkpoint_trigger(name)] if on_checkpoint else None,
                 description="Export a model for multi-host tensor-parallel inference (Kiln).",
                 entrypoint_type=EntrypointType.MODULE_PATH)


def _check_cron(cron: str) -> None:
    from prefect.client.schemas.schedules import CronSchedule

    try:
        CronSchedule(cron=cron)
    except ValueError:
        raise BadInput(f"--cron {cron!r} is not a valid cron expression; e.g. '0 3 * * *' is 03:00 daily.") from None
