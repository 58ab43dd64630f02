"""infra/prefect.yaml: `prefect deploy` creates the deployment, and a process worker runs it offline."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PREFECT = str(Path(sys.executable).parent / "prefect")


# On SQLite, Prefect's single-machine default: the one ops test that does not run on PostgreSQL. It runs
# everything in subprocesses (in-process Prefect clients keep services bound to the first server they saw).
@pytest.mark.parametrize("prefect_server", ["sqlite"], indirect=True)
def test_prefect_yaml_deploys_and_a_process_worker_runs_it(prefect_server, ops_env, tmp_path):
    def prefect(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
        proc = subprocess.run([PREFECT, *args], env={**ops_env, **(env or {})}, cwd=tmp_path,
                              capture_output=True, text=True, timeout=timeout)
        assert proc.returncode == 0, (args, proc.stdout[-3000:], proc.stderr[-3000:])
        return proc

    prefect("work-pool", "create", "kiln-process", "--type", "process", "--overwrite")
    prefect("--no-prompt", "deploy", "--prefect-file", str(REPO / "infra" / "prefect.yaml"), "--all")

    api = prefect_server.api()
    dep = api.deployment("kiln-export", "workers")
    assert dep["entrypoint"] == "flows.export.export" and dep["work_pool_name"] == "kiln-process"
    assert dep["pull_steps"] == [{"prefect.deployments.steps.set_working_directory":
                                  {"directory": "{{ $KILN_WORKDIR }}"}}]
    assert dep["parameters"] == {} and dep["enforce_parameter_schema"]
    assert list(dep["parameter_openapi_schema"]["properties"])[:2] == ["model", "tp"]
    [schedule] = dep["schedules"]
    assert schedule["schedule"]["cron"] == "0 3 * * *" and schedule["active"] is False
    # Its checkpoint trigger: an automation running this deployment, disabled, templates kept for the server.
    [trigger] = [a for a in api.post("/automations/filter", {}).json()
                 if any(act.get("deployment_id") == dep["id"] for act in a["actions"])]
    assert trigger["enabled"] is False and trigger["trigger"]["expect"] == ["kiln.checkpoint.ready"]
    from kiln.core.run.events import trigger_parameters
    assert trigger["actions"][0]["parameters"] == trigger_parameters()

    # A run the gate refuses right after its probe: it exercises the pull step, the
    # entrypoint and the parameters without compiling.
    created = api.post(f"/deployments/{dep['id']}/create_flow_run", {"parameters": {
        "recipe": {"buckets": "1x8", "headroom_floor_mib": 10000000, "flow_retries": 0}}})
    assert created.status_code == 201, created.text
    workdir = tmp_path / "workdir"
    workdir.mkdir()
    worker_env = {k: v for k, v in ops_env.items() if k != "KILN_HOME"}  # KILN_HOME defaults to ./.kiln
    subprocess.run([PREFECT, "worker", "start", "--pool", "kiln-process", "--run-once"],
                   env={**worker_env, "KILN_WORKDIR": str(workdir)}, cwd=tmp_path, capture_output=True,
                   text=True, timeout=600)
    run = api.wait_final(created.json()["id"], timeout_s=300)
    assert run["state_type"] == "FAILED" and "MiB short" in run["state"]["message"], run["state"]
    assert run["run_count"] == 1
    # The pull step moved the run into KILN_WORKDIR: the default KILN_HOME (./.kiln) is there.
    assert (workdir / ".kiln" / "models" / "tiny" / "config.json").exists()
