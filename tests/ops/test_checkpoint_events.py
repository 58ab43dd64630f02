"""Exports that start when a checkpoint is announced, and whose outcome is an event (a real Prefect server).

`kiln serve --on-checkpoint` makes the deployment's trigger (an automation the
server's event services evaluate); `kiln announce` emits kiln.checkpoint.ready;
each try of an export emits kiln.export.completed or kiln.export.failed, read
back here through the events API (POST /events/filter).

One test, one served deployment and one compile (1 bucket, a 1-layer
checkpoint uploaded to S3, moto_server, and exported from there): the same
checkpoint announced twice at once runs two exports one after the other (the
model lease), and the second compiles nothing (the store's keys); then a run
the gate refuses emits kiln.export.failed naming the short host.
"""

from __future__ import annotations

import socket
import time
import uuid
from pathlib import Path
from urllib.parse import urlparse

import pytest

pytestmark = pytest.mark.slow


def _events_of_runs(api, name: str, run_ids: list[str], timeout_s: float = 120.0) -> dict[str, dict]:
    """{flow run id: its event `name`}, read through the events API once every run has one (the server
    stores events a few seconds after they arrive); Prefect relates an event emitted in a run to the run."""
    related = [f"prefect.flow-run.{i}" for i in run_ids]
    deadline = time.monotonic() + timeout_s
    while True:
        r = api.post("/events/filter", {"filter": {"event": {"name": [name]}, "related": {"id": related}},
                                        "limit": 50})
        r.raise_for_status()
        found = {}
        for ev in r.json()["events"]:
            for rel in ev["related"]:
                if rel["prefect.resource.id"] in related:
                    found.setdefault(rel["prefect.resource.id"].removeprefix("prefect.flow-run."), []).append(ev)
        if len(found) == len(run_ids) or time.monotonic() > deadline:
            assert sorted(found) == sorted(run_ids), f"{name} events of runs {run_ids}: {found}"
            assert all(len(evs) == 1 for evs in found.values()), found  # one event per try
            return {i: evs[0] for i, evs in found.items()}
        time.sleep(2.0)


def _runs(api, deployment_id: str, want: int, timeout_s: float = 120.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while len(runs := api.flow_runs(deployment_id={"any_": [deployment_id]})) < want:
        if time.monotonic() > deadline:
            pytest.fail(f"the trigger created {len(runs)} of {want} flow runs within {timeout_s} s")
        time.sleep(1.0)
    return runs


def _busy_interval(api, run_id: str) -> tuple[str, str]:
    """From the first task run's start to the last one's end: when the run probed, compiled, verified."""
    tasks = [t for t in api.task_runs(run_id) if t["start_time"] and t["end_time"]]
    return min(t["start_time"] for t in tasks), max(t["end_time"] for t in tasks)


def test_an_announced_checkpoint_is_exported_once_per_event_and_each_outcome_is_an_event(
        s3_bucket, s3_server, serve, prefect_server, kiln_run, tmp_path):
    # s3_bucket first: its AWS settings (credentials, AWS_ENDPOINT_URL) are in the environment that ops_env
    # copies, so `kiln serve` and the runs it starts reach the S3 server.
    import boto3

    api = prefect_server.api()
    folder = tmp_path / f"ckpt-{uuid.uuid4().hex[:6]}"
    made = kiln_run("checkpoint", str(folder), "--layers", "1", timeout=300)
    assert made.returncode == 0, made.stderr
    bucket = s3_bucket[5:].split("/")[0]
    client = boto3.client("s3", endpoint_url=s3_server.endpoint_url)
    for f in sorted(folder.iterdir()):
        client.upload_file(str(f), bucket, f"checkpoints/{folder.name}/{f.name}")
    model = f"s3://{bucket}/checkpoints/{folder.name}"  # where training put it; no local copy is used
    name = folder.name
    served = serve("--on-checkpoint", "--buckets", "1x8", "--set", "flow_retries=0")
    deployment_id = served.deployment["id"]
    deadline = time.monotonic() + 60  # serve creates the deployment first, then its trigger
    def trigger_of_deployment() -> list[dict]:
        return [a for a in api.post("/automations/filter", {}).json()
                if a["trigger"].get("expect") == ["kiln.checkpoint.ready"]
                and any(act.get("deployment_id") == deployment_id for act in a["actions"])]

    while not trigger_of_deployment():
        assert time.monotonic() < deadline, "no checkpoint trigger for the deployment"
        time.sleep(1.0)

    # A burst: the same checkpoint announced twice, at once.
    announced = [kiln_run("announce", model, timeout=120) for _ in range(2)]
    for a in announced:
        assert a.returncode == 0, a.stderr
        assert f"kiln.checkpoint.{name}" in a.stdout
    runs = sorted(_runs(api, deployment_id, want=2), key=lambda r: r["created"])
    finals = [api.wait_final(r["id"], timeout_s=1200) for r in runs]
    for run in finals:
        assert run["state_type"] == "COMPLETED", (run["state"], served.log.read_text()[-4000:])
        # The model from the event; every other parameter from the deployment's defaults.
        assert run["parameters"]["model"] == model and run["parameters"]["export_id"] == ""
        assert run["parameters"]["recipe"] == {"buckets": "1x8", "flow_retries": 0}
    # One at a time: the later run probed only after the earlier one had finished its work (the model lease).
    finals.sort(key=lambda r: _busy_interval(api, r["id"]))
    (_, first_end), (second_start, _) = (_busy_interval(api, r["id"]) for r in finals)
    assert second_start >= first_end, (first_end, second_start)

    # Each try's outcome, through the events API.
    by_run = _events_of_runs(api, "kiln.export.completed", [r["id"] for r in finals])
    compiled = []
    for run in finals:
        ev = by_run[run["id"]]
        res = ev["resource"]
        assert res["prefect.resource.id"].startswith(f"kiln.export.{name}-tp2-")
        assert (res["kiln.model"], res["kiln.model-name"], res["kiln.tp"]) == (model, name, "2")
        assert (res["kiln.status"], res["kiln.final"], res["kiln.attempt"]) == ("completed", "true", "1")
        manifest = urlparse(res["kiln.manifest-url"])
        assert manifest.scheme == "file" and Path(manifest.path).is_file(), res["kiln.manifest-url"]
        assert res["prefect.resource.id"].removeprefix("kiln.export.") in manifest.path
        compiled.append((ev["payload"]["counts"]["compiled"], ev["payload"]["counts"]["reused"]))
    assert compiled == [(1, 0), (0, 1)]  # the same checkpoint again: its forward is the stored one

    # A run the gate refuses: kiln.export.failed, naming the short host, final (refusals are not retried).
    # (A bucket not in the store yet: with nothing to compile, the gate has nothing to refuse.)
    refused = api.post(f"/deployments/{deployment_id}/create_flow_run", {"parameters": {
        "model": model, "recipe": {"buckets": "2x8", "headroom_floor_mib": 10000000}}})
    assert refused.status_code == 201, refused.text
    run = api.wait_final(refused.json()["id"], timeout_s=600)
    assert run["state_type"] == "FAILED", run["state"]
    failed = _events_of_runs(api, "kiln.export.failed", [run["id"]])[run["id"]]
    res = failed["resource"]
    assert (res["kiln.status"], res["kiln.final"]) == ("failed", "true")
    assert res["kiln.short-hosts"] == socket.gethostname() and "kiln.manifest-url" not in res
    assert "MiB short" in failed["payload"]["error"]
    assert failed["payload"]["short_hosts"][socket.gethostname()]["short_mib"] > 0
