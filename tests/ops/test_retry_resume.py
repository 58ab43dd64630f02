"""Retries that resume: flow retries redo only what is missing; deterministic errors (a gate refusal
among them, unless the recipe sets retry_refusals) are never retried.

Runs `kiln export` (and the flow itself) against a real Prefect server and
reads attempts, task runs and logs back through its API.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def store_url(tmp_path_factory) -> str:
    """One store for the module: the second test re-runs on what the first left."""
    return f"file://{tmp_path_factory.mktemp('resume') / 'store'}"


@pytest.fixture
def ops_env(ops_env, signing_key_env) -> dict:
    """One signing key for the module's store: each test's own KILN_HOME would make its own development key,
    and an export reuses only forwards a key it trusts vouched for (docs/trust.md)."""
    return {**ops_env, **signing_key_env}


def _export_id(tag: str) -> str:
    return f"{tag}-{uuid.uuid4().hex[:8]}"


def test_interrupted_export_resumes_compiling_only_what_is_missing(kiln_run, prefect_server, store_url, tmp_path):
    export_id = _export_id("resume")
    report = tmp_path / "report.json"
    # One compile worker: try 1 compiles one forward, uploads it and fails; with two, the other forward would
    # compile alongside it and be thrown away with the failed try (a compile for nothing).
    run = kiln_run("export", "--buckets", "1x8,2x8", "--store", store_url, "--export-id", export_id,
                   "--set", "flow_retry_delay_s=1", "--set", "max_compile_workers=1", "--report", str(report),
                   env={"KILN_FAULT_AFTER_UPLOADS": "1"})
    assert run.returncode == 0, run.stderr[-4000:]
    r = json.loads(report.read_text())
    # Try 1 stored one forward and lost the connection; try 2 compiled only the other one.
    assert r["status"] == "completed"
    assert r["counts"] == {"forwards": 2, "compiled": 1, "reused": 1, "tuning_measured": 0}
    assert sorted(f["compiled_by"] is None for f in r["forwards"]) == [False, True]

    api = prefect_server.api()
    [flow_run] = api.runs_of_export(export_id)
    assert flow_run["state_type"] == "COMPLETED" and flow_run["run_count"] == 2
    compiles = [t for t in api.task_runs(flow_run["id"]) if t["name"].startswith("compile")]
    assert [t["state_type"] for t in compiles] == ["FAILED", "COMPLETED"]
    assert "injected fault" in compiles[0]["state"]["message"]
    logs = api.logs(flow_run["id"])
    assert f"try 2 of 3: resuming export {export_id}" in logs
    assert "gate: compile 1 forward(s)" in logs


def test_transient_store_error_is_retried_by_the_task(kiln_run, prefect_server, store_url, tmp_path):
    export_id = _export_id("flaky")
    report = tmp_path / "report.json"
    run = kiln_run("export", "--buckets", "1x8,2x8", "--store", store_url, "--export-id", export_id,
                   "--report", str(report), env={"KILN_FAULT_PROBE_ERRORS": "1"})
    assert run.returncode == 0, run.stderr[-4000:]
    r = json.loads(report.read_text())
    assert r["counts"]["forwards"] == 2 and r["counts"]["compiled"] + r["counts"]["reused"] == 2

    api = prefect_server.api()
    [flow_run] = api.runs_of_export(export_id)
    assert flow_run["state_type"] == "COMPLETED" and flow_run["run_count"] == 1  # the task absorbed it
    [probe] = [t for t in api.task_runs(flow_run["id"]) if t["name"].startswith("probe")]
    assert probe["state_type"] == "COMPLETED" and probe["run_count"] == 2


# Both flows fail without compiling; one process pays Prefect's and torch's start-up once.
_FAILING_RUNS = """
import json, sys
from flows.export import export
from flows.params import ExportParams

runs = {
    "bad_input": ExportParams(model=sys.argv[1], recipe={"flow_retry_delay_s": 1}),
    "refused": ExportParams(store=sys.argv[2],
                            recipe={"buckets": "1x8", "headroom_floor_mib": 10000000, "flow_retry_delay_s": 1}),
    "waits_for_memory": ExportParams(store=sys.argv[2],
                                     recipe={"buckets": "1x8", "headroom_floor_mib": 10000000, "flow_retries": 1,
                                             "flow_retry_delay_s": 1, "retry_refusals": True}),
}
print(json.dumps({name: str(export(**p.flow_parameters(), return_state=True).state_details.flow_run_id)
                  for name, p in runs.items()}))
"""


@pytest.fixture(scope="module")
def failing_runs(prefect_server, tmp_path_factory) -> dict:
    import os
    d = tmp_path_factory.mktemp("failing")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "KILN_"))}
    env.update(PREFECT_API_URL=prefect_server.api_url, PREFECT_HOME=str(d / "prefect"), KILN_HOME=str(d / "home"))
    proc = subprocess.run([sys.executable, "-c", _FAILING_RUNS, str(d / "no-such-checkpoint"), f"file://{d / 'store'}"],
                          env=env, cwd=d, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    ids = json.loads(proc.stdout.strip().splitlines()[-1])
    return {name: prefect_server.api().flow_run(i) for name, i in ids.items()}


def test_bad_input_is_not_retried(failing_runs, prefect_server):
    run = failing_runs["bad_input"]
    # flow_retries is 2 by default: a retried run would show run_count 3.
    assert run["state_type"] == "FAILED" and run["run_count"] == 1
    assert "does not exist" in run["state"]["message"]
    assert "not retried: BadInput" in prefect_server.api().logs(run["id"])


def test_gate_refusal_is_final(failing_runs, prefect_server):
    run = failing_runs["refused"]
    # flow_retries is 2 by default: a retried refusal would show run_count 3.
    assert run["state_type"] == "FAILED" and run["run_count"] == 1
    assert "MiB short" in run["state"]["message"]
    api = prefect_server.api()
    logs = api.logs_with(run["id"], "not retried: a refusal is final")
    assert "not retried: a refusal is final" in logs
    assert not any(s["name"] == "AwaitingRetry" for s in api.states(run["id"]))
    # The run page explains itself: one log line per phase end, one artifact of each kind that applies.
    assert "phase probe: ok in" in logs and "phase gate: failed in" in logs
    arts = [a for a in api.artifacts(run["id"]) if a["type"]]  # (Prefect's own failed-state record has none)
    assert sorted(a["key"].rsplit("-", 1)[1] for a in arts) == ["memory", "summary"]  # nothing compiled or written
    [summary] = [a for a in arts if a["key"].endswith("-summary")]
    assert summary["description"] == "Kiln export summary (final, try 1)"  # a refusal is final
    assert "MiB short" in summary["data"] and "nothing was signed" in summary["data"]


def test_gate_refusal_is_retried_with_a_fresh_probe_when_the_recipe_waits(failing_runs, prefect_server):
    run = failing_runs["waits_for_memory"]
    assert run["state_type"] == "FAILED" and run["run_count"] == 2
    assert "MiB short" in run["state"]["message"]
    api = prefect_server.api()
    probes = [t for t in api.task_runs(run["id"]) if t["name"].startswith("probe")]
    assert len(probes) == 2 and all(t["state_type"] == "COMPLETED" for t in probes)
    assert any(s["name"] == "AwaitingRetry" for s in api.states(run["id"]))
    # Two tries, one artifact of each kind: the second try updated the first's in place.
    arts = [a for a in api.artifacts(run["id"]) if a["type"]]
    assert sorted(a["key"].rsplit("-", 1)[1] for a in arts) == ["memory", "summary"]
    assert all(a["description"].endswith("(final, try 2)") for a in arts), [a["description"] for a in arts]
    assert not list(Path(run["parameters"]["store"].removeprefix("file://")).rglob("*.pt2"))
