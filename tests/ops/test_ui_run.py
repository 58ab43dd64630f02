"""The served deployment: schedules seen through the API, and a custom run started from the Prefect UI.

The UI test drives Debian's chromium (headless, no downloads) with Playwright:
deployments list -> the deployment -> Run -> Custom run -> the parameter form
(human titles, no type switches, the recipe's defaults visible; a bad bucket first, which the form must
refuse in words, then buckets 1x8) -> Submit. It reads the outcome back through the API (summary, forwards,
manifest, progress, logs, task runs), runs the same export again (everything reused, checks remembered),
and saves screenshots of the form and the runs under the test's tmp_path and .kiln/test-artifacts/.
"""

from __future__ import annotations

import datetime as dt
import json
import re
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


def _open_artifact(page, card: str, wait_text: str, shot: Path, height: int = 1000) -> None:
    """From a run's Artifacts tab: open the artifact whose card says `card`, wait for `wait_text`, take
    `shot` at `height` px, and come back to the tab."""
    page.get_by_text(card).first.click()
    page.get_by_text(wait_text).first.wait_for()
    page.set_viewport_size({"width": 1400, "height": height})
    page.screenshot(path=shot)
    page.set_viewport_size({"width": 1400, "height": 1000})
    page.go_back()
    page.get_by_text("Artifacts", exact=True).click()


def _labels(page) -> list[str]:
    return [t.strip() for t in page.locator(".p-label__label, .p-label legend, label").all_inner_texts() if t.strip()]


def _summary(api, run_id: str) -> tuple[str, dict, dict]:
    """(export id, {kind: artifact}, the summary artifact) of a finished run."""
    listed = [a for a in api.artifacts(run_id) if a["type"]]  # Kiln's (Prefect's own records have no type)
    arts = {a["key"]: a for a in listed}
    assert len(listed) == len(arts)  # one artifact of each kind
    [summary] = [a for a in listed if a["key"].endswith("-summary")]
    prefix = summary["key"].removesuffix("summary")  # the export id, lower case (Prefect's key rules)
    export_id = re.search(r"^# Kiln export `([^`]+)`", summary["data"], re.M)[1]
    assert prefix == f"{export_id.lower()}-"
    return export_id, {k.removeprefix(prefix): a for k, a in arts.items()}, summary


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

        # The form: human titles, no type switches, typed defaults (derived from flows/params.py and
        # kiln/core/plan/recipe.py). ("Optional": each has a default, so an API caller may leave it out.)
        labels = _labels(page)
        assert "S3 endpoint (Optional)" in labels and "Most KV pages per rank (Optional)" in labels, labels
        assert not [t for t in labels if "_" in t], labels
        assert not page.get_by_text("Property is type None").count()
        dtype = _prop(page, "Number format (Optional)")  # a dropdown, shown, with the checkpoint's as default
        assert dtype.locator(".p-select-button__value").first.inner_text().strip() == "checkpoint"
        buckets = _prop(page, "Buckets (Optional)")
        field = buckets.locator("textarea, input").first
        assert field.input_value() == "1x16,2x16,4x32,8x64"
        policy = _prop(page, "When a host cannot compile (Optional)")
        assert policy.locator(".p-select-button__value").first.inner_text().strip() == "borrow"
        assert _prop(page, "Headroom floor (MiB) (Optional)").locator("input").first.input_value() == "2048"
        assert _prop(page, "Memory per compile worker (MiB) (Optional)").locator("input").first.input_value() == "0"
        # Descriptions in the form's words: no setting's raw name, no title substituted into its own text.
        assert page.get_by_text("'Margin over the measured worker peak'", exact=False).count()
        assert not page.get_by_text("worker_mib_margin", exact=False).count()
        assert not page.get_by_text("Kernel 'Kernel tuning'", exact=False).count()
        assert page.get_by_text("listed by topic in this order: model and layout, store, memory and gate",
                                exact=False).count()  # what the form shows: an order, not sections
        page.screenshot(path=shots / "run-form.png", full_page=True)
        field.fill("ax3")
        page.get_by_role("button", name="Submit", exact=True).click()
        # The form refuses it in words: still on the form, nothing is created.
        page.get_by_text("write buckets like 1x16,4x64", exact=False).first.wait_for(timeout=15_000)
        page.screenshot(path=shots / "run-form-refused.png", full_page=True)
        assert "/run" in page.url and not api.flow_runs(name={"any_": [run_name]})
        assert not page.get_by_text("[1-9]").count()  # no raw regex shown

        field.fill("1x8")
        page.get_by_role("button", name="Submit", exact=True).click()
        page.wait_for_url("**/deployments/deployment/*?tab=Runs")

        [created] = api.flow_runs(name={"any_": [run_name]})
        assert created["deployment_id"] == served.deployment["id"]
        assert created["parameters"]["recipe"]["buckets"] == "1x8"
        # The form sends every setting, untouched ones at their defaults (kiln.core.plan.recipe.form_overrides).
        from kiln.core.plan.recipe import SETTINGS
        assert set(created["parameters"]["recipe"]) == {s.name for s in SETTINGS}
        run = api.wait_final(created["id"], timeout_s=900)
        assert run["state_type"] == "COMPLETED", (run["state"], served.log.read_text()[-4000:])

        page.goto(f"{prefect_server.url}/runs/flow-run/{run['id']}", wait_until="networkidle")
        page.get_by_text("Completed", exact=True).first.wait_for()
        page.screenshot(path=shots / "flow-run-logs.png", full_page=True)
        page.get_by_text("Artifacts", exact=True).click()
        page.get_by_text("Kiln export summary").wait_for()
        page.set_viewport_size({"width": 1400, "height": 1400})  # every artifact card in view
        page.screenshot(path=shots / "flow-run-artifacts.png")
        page.set_viewport_size({"width": 1400, "height": 1000})
        # The whole summary, links included.
        _open_artifact(page, "Kiln export summary", "Settings changed from the defaults", shots / "summary.png", 2400)
        _open_artifact(page, "Memory ledger, drawn", "Every host's memory at every phase", shots / "memory-ledger.png")
        _open_artifact(page, "The export's manifest", "Forwards and their interface", shots / "manifest.png", 1600)
        _open_artifact(page, "Forwards (final", "sha256", shots / "forwards.png", 600)  # every column in view

    export_id, arts, summary = _summary(api, run["id"])
    assert sorted(arts) == sorted(("summary", "forwards", "memory", "manifest", "progress"))
    assert summary["description"] == "Kiln export summary (final, try 1)"  # completed: no try follows
    data = summary["data"]
    for phase in ("probe", "tune", "kv-plan", "gate", "compile", "outcome-check", "share-verify", "manifest"):
        assert f"| {phase} |" in data
    assert "**Gate:** compiling: compile 1 forward(s)" in data and "## Memory ledger (MiB)" in data
    # A local store: paths shown as text, never file:// links a browser will not open.
    assert "Memory ledger picture: `" in data and "Manifest: `" in data and "file://" not in data
    assert "(the gate estimated" in data  # the compile phase beside the gate's estimate
    # The forwards by origin, the checks with their figures, one memory figure explained, the changes.
    assert "**Forwards:** 1 forward: 1 compiled by " in data
    assert "ranks 0, 1 against eager, 2 check(s) (2 checked now); largest difference " in data and "(limit " in data
    assert "a worker counted at " in data and "with the headroom, one worker needs " in data
    assert "- Recipe > Buckets: `1x8`" in data and "Headroom floor" not in data.split("Settings changed")[1]
    forwards = json.loads(arts["forwards"]["data"])
    # The unit in the header, numbers in the cells; the hashes last and short enough for a 1400 px page.
    assert list(forwards[0]) == ["shapes", "origin", "size (MiB)", "target", "key", "sha256"]
    assert [f["shapes"] for f in forwards] == ["1x8"] and forwards[0]["origin"].startswith("compiled by ")
    assert float(forwards[0]["size (MiB)"]) > 0 and len(forwards[0]["sha256"]) == 13  # 12 hex and "…"
    manifest = arts["manifest"]["data"]  # the manifest's contents, not only its path
    assert "**Ranks:** 2" in manifest and "## Forwards and their interface" in manifest and "## Weights (" in manifest
    assert forwards[0]["sha256"][:12] in manifest and "tokens int64 [1, 8]" in manifest
    assert " per rank, from offsets 0, " in manifest  # a weight's sources in words, not JSON
    progress = arts["progress"]
    assert progress["data"] == 100.0 and progress["updated"] > progress["created"]  # it advanced
    assert "per host " in progress["description"] and " 1/1" in progress["description"], progress["description"]
    assert "data:image/png;base64," in arts["memory"]["data"]
    logs = api.logs_with(run["id"], "done: manifest ")
    for phase in ("probe", "tune", "kv-plan", "gate", "outcome-check", "share-verify", "manifest"):
        assert f"phase {phase}: " in logs, phase
    assert "phase compile: ok in " in logs and "s (the gate estimated " in logs
    assert f"export {export_id} done: manifest " in logs and "; signature " in logs  # one closing line
    # Bookkeeping is no task run: only phases with work (or retries) are.
    names = {t["name"].rsplit("-", 1)[0] for t in api.task_runs(run["id"])}
    assert not names & {"forward-records", "store-picture"}, names
    store = Path(ops_env["KILN_HOME"]) / "store"
    [picture] = (store / "exports").glob("*/memory-*.png")
    assert picture.read_bytes()[:4] == b"\x89PNG"

    # The same export again: everything is in the store and the checks are remembered; the page says so,
    # and names the settings changed that did nothing (only compiling uses them).
    again = api.post(f"/deployments/{served.deployment['id']}/create_flow_run",
                     {"parameters": {"recipe": {"buckets": "1x8", "policy": "fail", "max_compile_workers": 3}}})
    assert again.status_code == 201, again.text
    rerun = api.wait_final(again.json()["id"], timeout_s=600)
    assert rerun["state_type"] == "COMPLETED", rerun["state"]
    _, arts2, summary2 = _summary(api, rerun["id"])
    assert "**Forwards:** 1 forward: 1 reused from the store" in summary2["data"]
    assert "(none checked now, 2 remembered from a verification on 20" in summary2["data"]
    assert "**Gate:** nothing to compile: every forward is already in the store" in summary2["data"]
    assert ("**Warning:** nothing to compile (every forward was already in the store), so the gate's and the "
            "compiler's settings were not needed; these did nothing in this run: Recipe > 'When a host cannot "
            "compile' (fail), Recipe > 'Most compile workers per host' (3)") in summary2["data"]
    assert json.loads(arts2["forwards"]["data"])[0]["origin"] == "reused from the store"
    with _browser_page() as page:
        page.goto(f"{prefect_server.url}/runs/flow-run/{rerun['id']}", wait_until="networkidle")
        page.get_by_text("Artifacts", exact=True).click()
        _open_artifact(page, "Kiln export summary", "remembered from a verification", shots / "rerun-summary.png",
                       2000)

    _keep(shots, keep_dir, "ui-run")


def test_a_refused_run_says_why_on_its_page(serve, prefect_server, tmp_path, keep_dir):
    """A run the gate refuses: its state message is the refusal, naming the short host, what one worker is
    counted at and the fix in the form's and the CLI's words; said once in the logs and the summary."""
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
    # The state message (the run's header, Details and the runs list) starts with the shortfall, then the fix
    # in the form's words with room to spare and the default, and ends saying that no try follows.
    assert re.match(rf"{re.escape(host)} is \d+ MiB short of one compile worker\. To fix: set Recipe > 'Headroom "
                    r"floor \(MiB\)' to \d+ in the run form \(CLI: --set headroom_floor_mib=\d+\)", message), message
    assert f"The figures: {host}: it has " in message and "(headroom 10000000 MiB + a worker counted at " in message
    fix = message.split("To fix: ")[1]
    assert " MiB to spare (Kiln keeps a margin of 1.15 x a worker's memory); the default is 2048 MiB" in fix
    assert message.endswith("Not retried: a refusal is final (to wait for memory instead, set Recipe > 'Retry "
                            "refusals' to true in the run form (CLI: --set retry_refusals=true)).")
    logs = api.logs_with(run["id"], "not retried: a refusal is final")
    assert logs.count("MiB short") == 1, logs  # the refusal, once
    assert "not retried: a refusal is final" in logs and "Flow run encountered an exception" not in logs
    gate = [t for t in api.task_runs(run["id"]) if t["name"].startswith("kv-plan-gate")]
    assert [t["state_type"] for t in gate] == ["FAILED"]  # the gate's task run is red
    _, arts, summary = _summary(api, run["id"])
    assert summary["description"] == "Kiln export summary (final, try 1)"
    assert summary["data"].count("MiB short") == 1 and \
        "**Gate:** refused: see the error above (when a host cannot compile: borrow)" in summary["data"]
    worker = message.split("a worker counted at ")[1].split(")")[0]
    assert f"a worker counted at {worker}" in summary["data"].split("**Memory per compile worker:**")[1]
    assert "- Recipe > Headroom floor (MiB): `10000000`" in summary["data"]
    shots = tmp_path / "screenshots"
    shots.mkdir()
    with _browser_page() as page:
        page.goto(f"{prefect_server.url}/runs/flow-run/{run['id']}", wait_until="networkidle")
        page.get_by_text("Failed", exact=True).first.wait_for()
        page.get_by_text("MiB short").first.wait_for()  # the refusal itself, on the run's page
        page.screenshot(path=shots / "refused-run.png", full_page=True)
        page.set_viewport_size({"width": 1400, "height": 500})  # the header, as a reader first sees it
        page.screenshot(path=shots / "refused-run-header.png")
        page.set_viewport_size({"width": 1400, "height": 1000})
        page.get_by_text("Details", exact=True).click()  # the state message: the shortfall and the fix lead
        page.get_by_text("State Message", exact=True).wait_for()
        page.get_by_text(message[:60], exact=False).first.wait_for()
        page.screenshot(path=shots / "refused-run-details.png")
        page.get_by_text("Artifacts", exact=True).click()
        page.get_by_text("Kiln export summary").wait_for()
        page.screenshot(path=shots / "refused-run-artifacts.png", full_page=True)
        _open_artifact(page, "Kiln export summary", "Memory per compile worker", shots / "refused-summary.png", 1800)
        _open_artifact(page, "Memory ledger, drawn", "Every host's memory at every phase",
                       shots / "refused-memory-ledger.png")
    _keep(shots, keep_dir, "ui-refused")
