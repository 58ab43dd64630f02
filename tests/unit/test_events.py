"""Kiln's event names, resources and labels (kiln/core/run/events.py), and the trigger's templates rendered as
Prefect's server renders them."""

from __future__ import annotations

import pytest

from kiln.core.run import events


def test_a_completed_export_names_its_manifest_and_is_final():
    name, resource, payload = events.export_event(
        export_id="m-tp2", model="/ckpt/m", tp=2, status="completed", attempt=1, final=True,
        store_url="s3://bucket/prefix/", manifest_key="exports/m-tp2/manifest.json",
        counts={"forwards": 1, "compiled": 0, "reused": 1})
    assert name == "kiln.export.completed"
    assert resource == {"prefect.resource.id": "kiln.export.m-tp2", "prefect.resource.name": "m-tp2",
                        "kiln.model": "/ckpt/m", "kiln.tp": "2", "kiln.status": "completed", "kiln.attempt": "1",
                        "kiln.final": "true", "kiln.manifest-url": "s3://bucket/prefix/exports/m-tp2/manifest.json"}
    assert all(isinstance(v, str) for v in resource.values())  # Prefect's labels are strings
    assert payload["counts"]["reused"] == 1 and payload["error"] is None


def test_a_refusal_names_its_short_hosts_and_has_no_manifest():
    short = {"host-1": {"short_mib": 250}, "host-0": {"short_mib": 349}}
    name, resource, payload = events.export_event(
        export_id="e", model="tiny", tp=3, status="failed", attempt=2, final=False, store_url="file:///s",
        manifest_key=None, short_hosts=short, error="refused")
    assert name == "kiln.export.failed"
    assert resource["kiln.short-hosts"] == "host-0,host-1" and resource["kiln.final"] == "false"
    assert "kiln.manifest-url" not in resource
    assert payload["short_hosts"] == short and payload["error"] == "refused"


def test_only_completed_or_failed_tries_have_events():
    with pytest.raises(ValueError, match="running"):
        events.export_event(export_id="e", model="tiny", tp=1, status="running", attempt=1, final=False,
                            store_url="", manifest_key=None)


def test_a_checkpoint_resource_carries_the_model_and_optionally_the_export_id():
    assert events.checkpoint_resource("s3://b/ckpt/step-9", "step-9") == {
        "prefect.resource.id": "kiln.checkpoint.step-9", "prefect.resource.name": "step-9",
        "kiln.model": "s3://b/ckpt/step-9"}
    assert events.checkpoint_resource("tiny", "tiny", "nightly")["kiln.export-id"] == "nightly"


@pytest.mark.parametrize("export_id", [None, "nightly-1"])
def test_the_trigger_templates_render_the_model_and_the_export_id_from_the_event(export_id):
    """The server's own rendering (prefect.server.events.actions.RunDeployment): a missing export id is empty,
    so the run takes the default one."""
    import asyncio
    import datetime as dt
    import uuid

    from prefect.server.events.actions import RunDeployment
    from prefect.server.events.schemas.automations import TriggeredAction
    from prefect.server.events.schemas.events import ReceivedEvent

    event = ReceivedEvent(event=events.CHECKPOINT_READY, id=uuid.uuid4(), occurred=dt.datetime.now(dt.timezone.utc),
                          resource=events.checkpoint_resource("/data/ckpt/m", "m", export_id))
    action = RunDeployment(source="selected", deployment_id=uuid.uuid4(), parameters=events.trigger_parameters())
    triggered = TriggeredAction.model_construct(triggering_event=event, triggering_labels={}, triggered=None,
                                                automation=None, action=action, id=uuid.uuid4())

    async def render():
        return await action.render_parameters(triggered)

    try:
        rendered = asyncio.run(render())
    except Exception as exc:  # the context building changed shape: say so, the ops test is the real proof
        pytest.fail(f"rendering the trigger's parameters failed: {type(exc).__name__}: {exc}")
    assert rendered == {"model": "/data/ckpt/m", "export_id": export_id or ""}  # not null: the form's empty


def test_the_worked_automation_in_operations_md_is_one_prefect_accepts():
    """docs/operations.md's notification on kiln.export.failed parses as a Prefect automation and matches a
    final failure of a Kiln export (the block's id filled in)."""
    import json
    import re
    import uuid
    from pathlib import Path

    from prefect.events.schemas.automations import AutomationCore

    doc = (Path(__file__).resolve().parents[2] / "docs" / "operations.md").read_text()
    [block] = re.findall(r"A worked automation.*?```json\n(.*?)```", doc, flags=re.S)
    spec = json.loads(block.replace("<the webhook block's id>", str(uuid.uuid4())))
    automation = AutomationCore.model_validate(spec)
    assert automation.trigger.expect == {events.EXPORT_FAILED}
    _, resource, _ = events.export_event(export_id="e", model="tiny", tp=2, status="failed", attempt=3, final=True,
                                         store_url="", manifest_key=None)
    for label, patterns in automation.trigger.match.items():
        value = resource[label]
        assert any(value == p or (p.endswith("*") and value.startswith(p[:-1]))
                   for p in ([patterns] if isinstance(patterns, str) else patterns)), (label, value)
