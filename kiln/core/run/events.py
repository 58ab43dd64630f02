"""Kiln's Prefect events: their names, resources and labels (pure; flows/outcome_events.py emits them).

Events in: `kiln.checkpoint.ready` says a checkpoint can be exported. Its
resource is `kiln.checkpoint.<name>` with the label `kiln.model`: the model as
`--model` takes it ('tiny', an absolute checkpoint directory, s3://...), and
optionally `kiln.export-id`. A deployment served with `--on-checkpoint` runs an
export of that model for each such event.

Events out: every try of an export emits `kiln.export.completed` or
`kiln.export.failed` about the resource `kiln.export.<export_id>`. Labels (all
strings, as Prefect requires): `kiln.model`, `kiln.tp`, `kiln.status`
('completed' or 'failed'), `kiln.attempt` (the try, from 1), `kiln.final`
('true' when no further try follows: an automation that notifies should match
it), `kiln.manifest-url` (completed only: store URL + manifest key) and, for a
gate refusal, `kiln.short-hosts` (the short hosts' names, comma-separated).
The payload holds the counts, the error and the short hosts' figures.
"""

from __future__ import annotations

CHECKPOINT_READY = "kiln.checkpoint.ready"
EXPORT_COMPLETED = "kiln.export.completed"
EXPORT_FAILED = "kiln.export.failed"

MODEL_LABEL = "kiln.model"
EXPORT_ID_LABEL = "kiln.export-id"
CHECKPOINT_PREFIX = "kiln.checkpoint."
EXPORT_PREFIX = "kiln.export."


def checkpoint_resource(model: str, name: str, export_id: str | None = None) -> dict[str, str]:
    """The resource of a `kiln.checkpoint.ready` event: checkpoint `name` (the model's short name), whose
    export takes `--model model` (and `--export-id export_id` when given)."""
    resource = {"prefect.resource.id": f"{CHECKPOINT_PREFIX}{name}", "prefect.resource.name": name,
                MODEL_LABEL: model}
    if export_id:
        resource[EXPORT_ID_LABEL] = export_id
    return resource


def trigger_parameters() -> dict[str, str]:
    """The flow parameters a `kiln.checkpoint.ready` event sets (Prefect renders each template from the
    event; every other parameter is the deployment's default). A missing export id renders as '' (the
    run form's "empty: a name of its own"; the parameter is not nullable)."""
    return {"model": "{{ event.resource['%s'] }}" % MODEL_LABEL,
            "export_id": "{{ event.resource.get('%s', '') }}" % EXPORT_ID_LABEL}


def manifest_url(store_url: str, manifest_key: str) -> str:
    """Where the manifest is: the store's URL joined with its key."""
    return f"{store_url.rstrip('/')}/{manifest_key}"


def export_event(*, export_id: str, model: str, tp: int, status: str, attempt: int, final: bool,
                 store_url: str, manifest_key: str | None, short_hosts: dict[str, dict] | None = None,
                 counts: dict | None = None, error: str | None = None) -> tuple[str, dict[str, str], dict]:
    """(event name, resource, payload) of one export try's outcome; `status` 'completed' or 'failed'."""
    if status not in ("completed", "failed"):
        raise ValueError(f"an export event is about a completed or failed try, not {status!r}")
    resource = {"prefect.resource.id": f"{EXPORT_PREFIX}{export_id}", "prefect.resource.name": export_id,
                MODEL_LABEL: model, "kiln.tp": str(tp), "kiln.status": status, "kiln.attempt": str(attempt),
                "kiln.final": "true" if final else "false"}
    if status == "completed" and manifest_key:
        resource["kiln.manifest-url"] = manifest_url(store_url, manifest_key)
    if short_hosts:
        resource["kiln.short-hosts"] = ",".join(sorted(short_hosts))
    payload = {"counts": dict(counts or {}), "error": error, "short_hosts": dict(short_hosts or {})}
    return (EXPORT_COMPLETED if status == "completed" else EXPORT_FAILED), resource, payload
