"""Pure parts of operations: parameter bounds, what is worth retrying, the ledger picture, faults."""

from __future__ import annotations

import struct

import kiln_faults as faults
import pytest
from pydantic import ValidationError

from flows.params import ExportParams, build_recipe, default_export_id, export_params, model_name
from kiln.core.errors import (
    BadInput,
    DiskError,
    ForwardsMissing,
    GateRefused,
    HostsLost,
    IntegrityError,
    KilnError,
    StoreError,
    VerifyMismatch,
)
from flows.report_out import draw, ledger_key, markdown
from kiln.core.plan.recipe import Recipe, recipe_from_text
from kiln.core.run.retry_rule import worth_retrying
from kiln.core.run.report import Report
from kiln.host.processes import faults as fault_points
from kiln.host.compile.compiler import CompileFailed

# --- parameters: the run form's bounds --------------------------------------------------------------

def test_empty_parameters_are_the_tiny_default_export():
    p = ExportParams.model_validate({})
    assert (p.model, p.tp, p.store, p.recipe.buckets, p.recipe.policy) == ("tiny", 2, "", "1x16,2x16,4x32,8x64",
                                                                          "borrow")


@pytest.mark.parametrize("bad", [{"tp": 0}, {"tp": 2000}, {"recipe": {"buckets": "ax3"}},
                                 {"recipe": {"buckets": "1x16,4"}}, {"recipe": {"buckets": "0x16"}},
                                 {"recipe": {"flow_retries": -1}}, {"recipe": {"flow_retries": 11}},
                                 {"recipe": {"flow_retry_delay_s": -1}}, {"recipe": {"nonsense": 1}},
                                 {"assume_available": {"h": -5}}, {"recipe": {"page_tokens": 0}},
                                 {"export_id": "a/b"}, {"recipe": {"policy": "lend"}}, {"nonsense": 1}])
def test_out_of_bounds_parameters_are_rejected(bad):
    with pytest.raises(ValidationError):
        ExportParams.model_validate(bad)


def test_schema_carries_bounds_for_the_ui():
    schema = ExportParams.model_json_schema()
    props = schema["properties"]
    assert props["tp"]["minimum"] == 1 and props["tp"]["maximum"] == 1024
    recipe = schema["$defs"]["RecipeSettings"]["properties"]
    assert recipe["flow_retries"]["maximum"] == 10 and recipe["flow_retries"]["default"] == 2
    # A bad bucket list is answered in words (jsonschema: "'write buckets like 1x16,4x64' was expected").
    assert recipe["buckets"]["if"]["pattern"] and recipe["buckets"]["else"] == {"const": "write buckets like 1x16,4x64"}
    assert recipe["buckets"]["default"] == "1x16,2x16,4x32,8x64" and "pattern" not in recipe["buckets"]
    assert recipe["policy"] == {**recipe["policy"], "enum": ["borrow", "fail"], "default": "borrow"}
    assert all(props[name].get("description") for name in props)
    assert all(recipe[name].get("description") for name in recipe)
    assert schema["additionalProperties"] is False
    assert schema["$defs"]["RecipeSettings"]["additionalProperties"] is False


def test_cli_values_out_of_bounds_are_bad_input_naming_the_flag():
    with pytest.raises(BadInput, match=r"--flow-retries 11.*less than or equal to 10"):
        export_params(recipe={"flow_retries": 11})
    with pytest.raises(BadInput, match="--tp 0"):
        export_params(tp=0)


def test_flow_retry_fields_reach_the_recipe():
    r = build_recipe(ExportParams(recipe={"flow_retries": 0, "flow_retry_delay_s": 1.5}))
    assert (r.flow_retries, r.flow_retry_delay_s) == (0, 1.5)
    assert (Recipe().flow_retries, Recipe().flow_retry_delay_s) == (2, 30.0)
    assert build_recipe(export_params(recipe={"flow_retries": 5})).flow_retries == 5


@pytest.mark.parametrize("item", ["flow_retries=-1", "flow_retry_delay_s=-2", "flow_retries=x"])
def test_bad_flow_retry_settings(item):
    with pytest.raises(BadInput):
        recipe_from_text([item])


def test_default_export_id_is_stable_for_one_run(tmp_path):
    import datetime as dt
    when = dt.datetime(2026, 1, 2, 3, 4, 5, tzinfo=dt.timezone.utc)
    p = ExportParams(model=str(tmp_path / "my-model"), tp=4)
    assert default_export_id(p, when, "ab12") == "my-model-tp4-20260102T030405-ab12"
    assert default_export_id(p, when, "ab12") == default_export_id(p, when, "ab12")
    assert model_name(ExportParams()) == "tiny"


# --- what a flow retry may repeat ----------------------------------------------------------------------

@pytest.mark.parametrize("exc", [BadInput("x"), GateRefused("short"), IntegrityError("x"), VerifyMismatch("x"),
                                 KeyboardInterrupt(), TypeError("a bug"), KeyError("a bug"),
                                 KilnError("forwards missing"), StoreError("access denied"), DiskError("full"),
                                 OSError(28, "No space left on device")])
def test_deterministic_errors_are_not_worth_retrying(exc):
    assert not worth_retrying(exc)


def test_a_refusal_is_retried_only_when_the_recipe_waits_for_memory():
    assert Recipe().retry_refusals is False
    assert worth_retrying(GateRefused("short"), retry_refusals=True)
    assert not worth_retrying(BadInput("x"), retry_refusals=True)
    assert build_recipe(ExportParams(recipe={"retry_refusals": True})).retry_refusals is True
    assert recipe_from_text(["retry_refusals=true"]).retry_refusals is True


def test_parameter_validation_errors_are_not_worth_retrying():
    with pytest.raises(ValidationError) as info:
        ExportParams(tp=0)
    assert not worth_retrying(info.value)


@pytest.mark.parametrize("exc", [ConnectionError("reset"), HostsLost("gone"),
                                 ForwardsMissing("forwards missing after compile"),
                                 OSError(5, "Input/output error"), TimeoutError()])
def test_transient_errors_are_worth_retrying(exc):
    assert worth_retrying(exc)


@pytest.mark.parametrize("exc", [StoreError("down", transient=True), CompileFailed("killed")])
def test_what_its_own_level_retried_is_not_worth_retrying(exc):
    # The store's per-request retries, the compile pool's max_compile_attempts: spent before the flow sees it.
    assert not worth_retrying(exc)


# --- the memory ledger picture ----------------------------------------------------------------------------

def _png_size(png: bytes) -> tuple[int, int]:
    assert png[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", png[16:24])


HOST = {"name": "h1", "memory": [
    {"phase": "start", "host_available_mib": 20000, "device_free_mib": None},
    {"phase": "probe", "host_available_mib": 12038, "device_free_mib": 9000, "assumed_available_mib": 11000},
    {"phase": "gate", "host_available_mib": None, "device_free_mib": None}]}


def test_ledger_picture_has_one_panel_per_host():
    one = draw([HOST])
    two = draw([HOST, {**HOST, "name": "h2"}])
    (w1, h1), (w2, h2) = _png_size(one), _png_size(two)
    assert w1 == w2 and h2 > h1 + 150  # a second panel below the first


def test_ledger_picture_without_hosts_still_draws():
    assert _png_size(draw([]))[0] > 0


def test_ledger_key_is_content_addressed_under_the_export():
    png = draw([HOST])
    key = ledger_key("exp-1", png)
    assert key.startswith("exports/exp-1/memory-") and key.endswith(".png")
    assert ledger_key("exp-1", png + b"x") != key


def test_ledger_markdown_inlines_the_picture_and_says_where_it_is():
    text = markdown(b"\x89PNG-bytes", "s3://b/p/exports/e/memory-1.png", "https://s3.example/presigned")
    assert "](data:image/png;base64," in text and "[s3://b/p/exports/e/memory-1.png](https://s3.example/presigned)" in text
    local = markdown(b"\x89PNG-bytes", "/s/exports/e/memory-1.png")
    assert "Stored at `/s/exports/e/memory-1.png`" in local and "](/s" not in local and "file://" not in local
    assert "Not stored" in markdown(b"\x89PNG-bytes", None)


def test_a_refusal_draws_what_the_short_host_needed():
    r = Report("e1", model="tiny", tp=2, store="file:///s/")
    r.memory("h1", "start", {"host_available_mib": 20184, "device_free_mib": None})
    r.record_shortfall({"h1": {"available_mib": 20184, "required_one_mib": 67584, "short_mib": 47400}})
    assert r.hosts["h1"]["required_one_mib"] == 67584 and r.hosts["h1"]["short_mib"] == 47400
    assert draw(list(r.hosts.values()))[:4] == b"\x89PNG"


def test_summary_links_open_in_a_browser_or_are_paths():
    r = Report("e1", model="tiny", tp=2, store="file:///s/")
    r.ledger_picture, r.manifest = "exports/e1/memory-abc.png", "exports/e1/manifest.json"
    md = r.markdown({r.ledger_picture: ("/s/exports/e1/memory-abc.png", None),
                     r.manifest: ("s3://b/exports/e1/manifest.json", "https://s3.example/presigned")})
    assert "Memory ledger picture: `/s/exports/e1/memory-abc.png`" in md
    assert "Manifest: [s3://b/exports/e1/manifest.json](https://s3.example/presigned)" in md
    assert "file://" not in md
    assert r.to_dict()["ledger_picture"] == "exports/e1/memory-abc.png"


def test_the_summary_says_signed_only_when_a_manifest_was_written():
    r = Report("e1", model="tiny", tp=2, store="file:///s/")
    r.signing = {"signed": True, "note": "signed with ed25519:abc (development key)"}
    assert "nothing was signed" in r.markdown() and "signed with" not in r.markdown()
    r.manifest = "exports/e1/manifest.json"
    assert "Signing: signed with ed25519:abc" in r.markdown()


# --- fault injection (tests of retries use it) ---------------------------------------------------------

def test_faults_do_nothing_unless_set(monkeypatch):
    monkeypatch.delenv("KILN_FAULT_AFTER_UPLOADS", raising=False)
    monkeypatch.delenv("KILN_FAULT_PROBE_ERRORS", raising=False)
    monkeypatch.setattr(faults, "_fired", {})
    fault_points.point("uploaded", 5)  # the seam is installed in this process (tests/conftest.py)
    fault_points.point("probe")


def test_upload_fault_fires_once_after_n_uploads(monkeypatch):
    monkeypatch.setenv("KILN_FAULT_AFTER_UPLOADS", "2")
    monkeypatch.setattr(faults, "_fired", {})
    fault_points.point("uploaded", 1)
    with pytest.raises(ConnectionError, match="after 2 upload"):
        fault_points.point("uploaded", 2)
    fault_points.point("uploaded", 3)  # a retry in the same process runs clean


def test_fault_points_call_only_what_was_installed():
    calls = []
    uninstall = fault_points.install("probe", lambda: calls.append("probe"))
    fault_points.point("probe")
    uninstall()
    fault_points.point("probe")
    assert calls == ["probe"]
    with pytest.raises(ValueError, match="unknown fault point"):
        fault_points.install("nowhere", print)


def test_probe_fault_fires_n_times(monkeypatch):
    monkeypatch.setenv("KILN_FAULT_PROBE_ERRORS", "1")
    monkeypatch.setattr(faults, "_fired", {})
    with pytest.raises(ConnectionError):
        fault_points.point("probe")
    fault_points.point("probe")


def test_the_verify_verdict_names_the_worst_forward():
    from kiln.core.errors import VerifyMismatch
    from kiln.core.run.outcome import check_verified

    check_verified({"1x8 rank 0": {"diff": 1e-4, "limit": 1e-3}}, "h", "float32")
    checks = {"1x8 rank 0": {"diff": 2e-3, "limit": 1e-3}, "2x8 rank 1": {"diff": 5e-3, "limit": 1e-3},
              "4x8 rank 0": {"diff": 1e-5, "limit": 1e-3}}
    with pytest.raises(VerifyMismatch, match=r"2x8 rank 1 on h differs from eager by 5.00e-03 .*bfloat16"):
        check_verified(checks, "h", "bfloat16")


def test_artifact_links_expire_after_the_recipes_hours_not_days(monkeypatch):
    """Presigned URLs go into artifacts everyone with UI access reads: hours by default, a recipe setting."""
    from types import SimpleNamespace

    from flows import artifacts

    assert Recipe().artifact_link_s <= 24 * 3600
    asked, put = [], {}

    class S3Like:
        def link(self, key, expires_s):
            asked.append(expires_s)
            return f"s3://b/{key}", f"https://s3.example/{key}?X-Amz-Expires={expires_s}"

    monkeypatch.setattr(artifacts, "store_of", lambda job: S3Like())
    monkeypatch.setattr(artifacts, "_put", lambda kind, report, data, description: put.setdefault(kind, data))
    r = Report("e1", model="tiny", tp=2, store="s3://b/")
    r.manifest = "exports/e1/manifest.json"
    job = SimpleNamespace(recipe=Recipe(artifact_link_s=3 * 3600))
    artifacts.publish(r, job, max_tries=1, final=True)
    assert asked == [3 * 3600]
    assert "valid 3 hours" in put["summary"] and "artifact_link_s" in put["summary"]
    with pytest.raises(Exception):
        Recipe(artifact_link_s=8 * 86400)  # longer than S3 signs for
