"""The served deployment: schedules seen through the API, and a custom run started from the Prefect UI.

The UI test drives Debian's chromium (headless, no downloads) with Playwright:
deployments list -> the deployment -> Run -> Custom run -> the parameter form
(the recipe's defaults visible, a bad bucket first, which the form must refuse, then buckets 1x8) -> Submit.
It reads the outcome back through the API and saves screenshots of the
finished run under the test's tmp_path and .kiln/test-artifacts/.
"""

from __future__ import annotations

import datetime as dt
import json
import shutil
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


def _scheduled_runs(api, deployment_id: str, at_least: int, timeout_s: float = 90.0) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while True:
        runs = [r for r in api.flow_runs(deployment_id={"any_": [deployment_id]})
                if r["state_type"] == "SCHEDULED"]
        if len(runs) >= at_least or time.monotonic() > deadline:
            return sorted(runs, key=lambda r: r["expected_start_time"])
        time.sleep(2.0)


@pytest.mark.parametrize("flags, step", [(("--cron", "0 3 * * *"), dt.timedelta(days=1)),
                                         (("--interval", "21600"), dt.timedelta(hours=6))])
def test_scheduled_deployment_shows_its_next_runs(serve, prefect_server, flags, step):
    served = serve(*flags)
    api = prefect_server.api()
    runs = _scheduled_runs(api, served.deployment["id"], at_least=3)
    assert len(runs) >= 3, runs
    starts = [dt.datetime.fromisoformat(r["expected_start_time"]) for r in runs]
    now = dt.datetime.now(dt.timezone.utc)
    assert all(s > now for s in starts)
    assert all(b - a == step for a, b in zip(starts, starts[1:]))
    if flags[0] == "--cron":
        assert all((s.hour, s.minute) == (3, 0) for s in starts)
    # A run with no parameters exports the tiny model to the default store.
    assert all(r["parameters"] == {} for r in runs)


def test_api_refuses_out_of_bounds_parameters(serve, prefect_server):
    served = serve()
    api = prefect_server.api()
    bad = api.post(f"/deployments/{served.deployment['id']}/create_flow_run",
                   {"parameters": {"tp": 0, "recipe": {"buckets": "ax3"}}})
    assert bad.status_code in (409, 422), bad.text
    assert not api.flow_runs(deployment_id={"any_": [served.deployment["id"]]})
    schema = served.deployment["parameter_openapi_schema"]
    assert schema["properties"]["tp"]["default"] == 2 and "recipe" in schema["properties"]


@contextmanager
def _browser_page():
    """A headless Debian chromium page (Playwright, no browser download); skips without chromium."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is absent (apt-get install chromium; `make setup` does it)")
    sync_playwright = pytest.importorskip("playwright.sync_api").sync_playwright
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=str(CHROMIUM), headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(60_000)
        try:
            yield page
        finally:
            browser.close()


def _keep(shots: Path, keep_dir: Path, prefix: str) -> None:
    """Copy the screenshots where a reviewer looks (.kiln/test-artifacts)."""
    for shot in shots.iterdir():
        shutil.copy(shot, keep_dir / f"{prefix}-{shot.name}")


def _prop(page, label: str):
    """The schema form's field whose label is `label` (innermost match)."""
    return page.locator(".p-label").filter(has=page.get_by_text(label, exact=True)).last


def test_custom_run_from_the_ui_completes_and_shows_kiln_artifacts(serve, prefect_server, ops_env, tmp_path,
                                                                   keep_dir):
    served = serve()
    api = prefect_server.api()
    run_name = f"ui-{uuid.uuid4().hex[:8]}"
    shots = tmp_path / "screenshots"
    shots.mkdir()
    with _browser_page() as page:
        page.goto(f"{prefect_server.url}/deployments", wait_until="networkidle")
        page.get_by_role("link", name=served.name, exact=True).click()
        page.wait_for_url("**/deployments/deployment/**")
        page.get_by_role("button", name="Run", exact=True).click()
        page.get_by_text("Custom run", exact=True).click()
        page.wait_for_url("**/run?**")
        page.wait_for_load_state("networkidle")
        _prop(page, "Run Name").locator("input").first.fill(run_name)

        # The recipe's settings are typed fields with their defaults filled in (derived from kiln/core/recipe.py).
        # ("Optional": each has a default, so an API caller may leave it out.)
        buckets = _prop(page, "Buckets (Optional)")
        field = buckets.locator("textarea, input").first
        assert field.input_value() == "1x16,2x16,4x32,8x64"
        policy = _prop(page, "Policy (Optional)")  # a dropdown with the default selected
        assert policy.locator(".p-select-button__value").first.inner_text().strip() == "borrow"
        assert _prop(page, "Headroom floor (MiB) (Optional)").locator("input").first.input_value() == "2048"
        page.screenshot(path=shots / "run-form.png", full_page=True)
        field.fill("ax3")
        page.get_by_role("button", name="Submit", exact=True).click()
        page.wait_for_timeout(3000)  # the form refuses it: still on the form, nothing is created
        page.screenshot(path=shots / "run-form-refused.png", full_page=True)
        assert "/run" in page.url and not api.flow_runs(name={"any_": [run_name]})

        field.fill("1x8")
        page.get_by_role("button", name="Submit", exact=True).click()
        page.wait_for_url("**/deployments/deployment/*?tab=Runs")

        [created] = api.flow_runs(name={"any_": [run_name]})
        assert created["deployment_id"] == served.deployment["id"]
        assert created["parameters"]["recipe"]["buckets"] == "1x8"
        run = api.wait_final(created["id"], timeout_s=900)
        assert run["state_type"] == "COMPLETED", (run["state"], served.log.read_text()[-4000:])

        page.goto(f"{prefect_server.url}/runs/flow-run/{run['id']}", wait_until="networkidle")
        page.get_by_text("Completed", exact=True).first.wait_for()
        page.get_by_text("Artifacts", exact=True).click()
        page.get_by_text("Kiln export summary").wait_for()
        page.set_viewport_size({"width": 1400, "height": 1400})  # every artifact card in view
        page.screenshot(path=shots / "flow-run-artifacts.png")
        page.get_by_text("Kiln export summary").click()
        page.get_by_text("Memory ledger (MiB)").wait_for()
        page.set_viewport_size({"width": 1400, "height": 2000})  # the whole summary, links included
        page.screenshot(path=shots / "summary.png")
        page.set_viewport_size({"width": 1400, "height": 1000})
        page.go_back()
        page.get_by_text("Artifacts", exact=True).click()
        page.get_by_text("Memory ledger, drawn").click()
        page.get_by_role("img", name="memory ledger").wait_for()
        page.screenshot(path=shots / "memory-ledger.png")

    listed = [a for a in api.artifacts(run["id"]) if a["type"]]  # Kiln's (Prefect's own records have no type)
    arts = {a["key"]: a for a in listed}
    [summary] = [a for a in listed if a["key"].endswith("-summary")]
    export_id = summary["key"].removesuffix("-summary")
    # One artifact of each kind, keyed by the export; the summary says which try it shows.
    assert sorted(arts) == sorted(f"{export_id}-{k}" for k in ("summary", "forwards", "memory", "manifest", "progress"))
    assert len(listed) == len(arts)
    assert summary["description"] == "Kiln export summary (try 1 of 3)"
    for phase in ("probe", "tune", "kv-plan", "gate", "compile", "outcome-check", "share-verify", "manifest"):
        assert f"| {phase} |" in summary["data"]
    assert "**Gate:** compile" in summary["data"] and "## Memory ledger (MiB)" in summary["data"]
    # A local store: paths shown as text, never file:// links a browser will not open.
    assert "Memory ledger picture: `" in summary["data"] and "Manifest: `" in summary["data"]
    assert "file://" not in summary["data"]
    assert "(the gate estimated" in summary["data"]  # the compile phase beside the gate's estimate
    forwards = json.loads(arts[f"{export_id}-forwards"]["data"])
    assert [f["bucket"] for f in forwards] == ["1x8"] and forwards[0]["compiled_by"]
    assert list(forwards[0]) == ["bucket", "compiled_by", "compile_s", "size_bytes", "key", "sha256"]
    logs = api.logs(run["id"])
    for phase in ("probe", "tune", "kv-plan", "gate", "outcome-check", "share-verify", "manifest"):
        assert f"phase {phase}: " in logs, phase
    assert "phase compile: ok in " in logs and "s (the gate estimated " in logs
    progress = arts[f"{export_id}-progress"]
    assert progress["data"] == 100.0 and progress["updated"] > progress["created"]  # it advanced
    assert "manifest.json" in arts[f"{export_id}-manifest"]["data"]
    assert "data:image/png;base64," in arts[f"{export_id}-memory"]["data"]
    store = Path(ops_env["KILN_HOME"]) / "store"
    [picture] = (store / "exports").glob("*/memory-*.png")
    assert picture.read_bytes()[:4] == b"\x89PNG"

    _keep(shots, keep_dir, "ui-run")


def test_a_refused_run_says_why_on_its_page(serve, prefect_server, tmp_path, keep_dir):
    """A run the gate refuses: its state message is the refusal, naming the short host, and its page shows it."""
    import socket

    served = serve()
    api = prefect_server.api()
    created = api.post(f"/deployments/{served.deployment['id']}/create_flow_run", {"parameters": {
        "recipe": {"buckets": "1x8", "headroom_floor_mib": 10000000}}})
    assert created.status_code == 201, created.text
    run = api.wait_final(created.json()["id"], timeout_s=600)
    message = run["state"]["message"]
    host = socket.gethostname()
    assert run["state_type"] == "FAILED" and run["run_count"] == 1, run["state"]
    assert f"{host} has " in message and "MiB short" in message, message
    shots = tmp_path / "screenshots"
    shots.mkdir()
    with _browser_page() as page:
        page.goto(f"{prefect_server.url}/runs/flow-run/{run['id']}", wait_until="networkidle")
        page.get_by_text("Failed", exact=True).first.wait_for()
        page.get_by_text("MiB short").first.wait_for()  # the refusal itself, on the run's page
        page.screenshot(path=shots / "refused-run.png", full_page=True)
        page.get_by_text("Artifacts", exact=True).click()
        page.get_by_text("Kiln export summary").wait_for()
        page.screenshot(path=shots / "refused-run-artifacts.png", full_page=True)
    _keep(shots, keep_dir, "ui-refused")
