"""The export spine end to end: real compilation, a local store; the session's cold export on the embedded
Prefect API (the default setup), the other exports on the session's Prefect server (the `kiln` fixture).

Every test looks at the session's export (tp2_export); a test that changes its store changes a copy
(tp2_store_copy). `kiln plan` and refusals that come before Prefect or any rank run in this process
(kiln_main); exit codes 0, 1 and 3 stay proven here through `kiln` subprocesses.
"""

from __future__ import annotations

import hashlib
import json
import math
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

PHASES = ["probe", "tune", "kv-plan", "gate", "compile", "outcome-check", "share-verify", "manifest"]


@pytest.fixture(scope="module")
def exported(tp2_export):
    return tp2_export


def test_cold_export_compiles_each_forward_once(exported):
    r = exported["cold_report"]
    assert r["status"] == "completed" and r["error"] is None
    assert [p["name"] for p in r["phases"]] == PHASES
    assert all(p["status"] in ("ok", "skipped") for p in r["phases"])
    # The default buckets (1x16, 2x16, 4x32, 8x64) as the default shape policy groups them: batch 1 static,
    # the rest one range compiled for its largest shape; one artifact per forward, shared by both ranks.
    assert [(f["shapes"], f["batch"], f["tokens"], f["hint"]) for f in r["forwards"]] == [
        ("1x16", [1, 1], [16, 16], [1, 16]), ("2-8x16-64@8x64", [2, 8], [16, 64], [8, 64])]
    assert r["counts"] == {"forwards": 2, "compiled": 2, "reused": 0, "tuning_measured": 0}
    host = r["hosts"][0]
    assert host["ranks"] == [0, 1] and host["workers"] >= 1
    assert all(f["compiled_by"] == host["name"] and f["compile_s"] > 0 for f in r["forwards"])
    assert r["gate"]["decision"] == "compile" and r["gate"]["policy"] == "borrow"
    assert all(f["compile_attempts"] == 1 for f in r["forwards"])


def test_quick_start_signs_with_the_local_development_key(exported, kiln_env):
    r = exported["cold_report"]
    key_file = Path(kiln_env["KILN_HOME"]) / "keys" / "dev-signing.key"
    assert r["signing"]["signed"] is True and r["signing"]["source"] == "dev"
    # Created by the first export of the session's KILN_HOME (this one, unless another test ran first).
    assert f"from the local development key {key_file}" in exported["cold"].err and key_file.is_file()
    assert "(created now)" not in exported["warm"].err and "kiln keygen DIR" in exported["warm"].err
    assert f"signed: yes, {r['signing']['key_fingerprint']}" in exported["cold"].out
    root = Path(exported["store"].removeprefix("file://"))
    manifest = json.loads((root / r["manifest"]).read_text())
    sig = json.loads((root / r["signing"]["signature"]).read_text())
    assert manifest["signing"] == {"signed": True, "key_fingerprint": r["signing"]["key_fingerprint"]}
    assert sig["key_fingerprint"] == r["signing"]["key_fingerprint"]
    assert exported["warm_report"]["signing"]["key_fingerprint"] == r["signing"]["key_fingerprint"]


def test_tune_phase_reports_why_cpu_forwards_are_not_tuned(exported):
    for name in ("cold_report", "warm_report"):
        tune = next(p for p in exported[name]["phases"] if p["name"] == "tune")
        assert tune["status"] == "skipped" and tune["measured"] == 0 and "prepack" in tune["reason"]
        assert len(tune["runs"]) == 1, "one tuning run per distinct target"
    assert all(f["tuning"] is None and f["autotune"] is None for f in exported["cold_report"]["forwards"])


def test_artifacts_in_store_match_recorded_sha256(exported):
    r = exported["cold_report"]
    root = Path(exported["store"].removeprefix("file://"))
    for f in r["forwards"]:
        data = (root / f["object"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == f["sha256"]
        assert len(data) == f["size_bytes"]
        assert len(data) < 5 * 2**20, "the package must not hold the weights"
    manifest = json.loads((root / r["manifest"]).read_text())
    assert {f["key"] for f in manifest["forwards"]} == {f["key"] for f in r["forwards"]}
    assert manifest["kv_plan"]["pages_per_rank"] > 0
    # What a consumer's CPU must have to run each package (docs/run-without-kiln.md): this host's CPU.
    from kiln.host.machine.probe import cpu_description

    here = cpu_description()
    assert all(f["target"] == here.fingerprint and f["target_cpu"] == here.to_dict() for f in manifest["forwards"])


def test_memory_ledger_has_every_phase_boundary(exported):
    host = exported["cold_report"]["hosts"][0]
    # Every boundary, and the lowest reading while compiling (sampled during the phase).
    assert [m["phase"] for m in host["memory"]] == ["start", *PHASES[:4], "compile (lowest)", *PHASES[4:]]
    assert all(m["host_available_mib"] > 0 for m in host["memory"])


def test_progress_counts_all_forwards(exported):
    assert "Compile forwards: 2/2 (all hosts" in exported["cold"].err


def test_warm_export_compiles_nothing(exported):
    r = exported["warm_report"]
    assert r["counts"] == {"forwards": 2, "compiled": 0, "reused": 2, "tuning_measured": 0}
    assert r["gate"]["decision"] == "nothing_to_do"
    assert {f["key"] for f in r["forwards"]} == {f["key"] for f in exported["cold_report"]["forwards"]}
    compile_phase = next(p for p in r["phases"] if p["name"] == "compile")
    assert compile_phase["status"] == "skipped"


def test_verify_runs_all_ranks_against_unsharded(kiln, kiln_env, exported, tmp_path):
    r = exported["cold_report"]
    pinned = tmp_path / "pinned"
    v = kiln("verify", "--store", exported["store"], r["export_id"], "--pin", str(pinned))
    assert v.code == 0, v.err[-3000:]
    assert f"signature ok: signed by {r['signing']['key_fingerprint']}" in v.out
    assert "sha256 ok for 2 artifact(s)" in v.out and "runtime input checks on" in v.out
    assert "  1x16: 2 ranks together vs unsharded eager at 1 shape(s)" in v.out
    # The range's four corners, its hint (8x64, a corner) and an interior shape (5x39).
    assert "  2-8x16-64@8x64: 2 ranks together vs unsharded eager at 5 shape(s)" in v.out
    assert "verify ok" in v.out
    # The pinned folder: what was verified, private, readable by the consumers as they read a store.
    from kiln.core.trust import signing
    from kiln.host.trust.signers import dev_key

    assert f"pinned: {pinned}" in v.out and (pinned.stat().st_mode & 0o777) == 0o700
    manifest = json.loads((pinned / "manifest.json").read_text())
    key = dev_key(Path(kiln_env["KILN_HOME"]))[0].public_key()
    assert signing.verify_manifest(manifest, json.loads((pinned / "manifest.sig").read_text()),
                                   {signing.fingerprint(key): key}, what="the pinned manifest")
    for f in manifest["forwards"]:
        package = pinned / "forwards" / f["object"].removeprefix("forwards/")
        assert hashlib.sha256(package.read_bytes()).hexdigest() == f["sha256"]
        assert (package.stat().st_mode & 0o777) == 0o600
    again = kiln("verify", "--store", exported["store"], r["export_id"], "--pin", str(pinned))
    assert again.code == 2 and "not a new or empty folder" in again.err


def test_verify_refuses_a_tampered_artifact(kiln, exported, tp2_store_copy):
    r = exported["cold_report"]
    blob = (tp2_store_copy["root"] / r["forwards"][0]["object"]).resolve()  # the bytes behind the store's key
    bad = bytearray(blob.read_bytes())
    bad[len(bad) // 2] ^= 0xFF
    blob.write_bytes(bytes(bad))
    v = kiln("verify", "--store", tp2_store_copy["store"], r["export_id"])
    assert v.code == 1
    assert r["forwards"][0]["object"] in v.err or r["forwards"][0]["key"] in v.err
    assert "Traceback" not in v.err and "verify ok" not in v.out


def test_verify_names_a_rank_that_died_and_ends_at_once(kiln, exported, tmp_path):
    # Rank 1 SIGKILLs itself as it starts its first forward (tests/fault_seam/): a segfault or the OOM killer.
    r = exported["cold_report"]
    v = kiln("verify", "--store", exported["store"], r["export_id"], timeout=600,
             env={"KILN_FAULT_KILL_RANK": "1:running forward", "KILN_FAULT_DIR": str(tmp_path)})
    ended = time.time()
    assert v.code == 1, v.err[-3000:]
    assert "kiln: rank 1 died with signal SIGKILL (-9) while running forward 1x16 at 1x16; the other rank was stopped." \
        in v.err, v.err[-3000:]
    assert "Traceback" not in v.err and "verify ok" not in v.out
    assert ended - float((tmp_path / "kill-rank-1").read_text()) < 30, "kiln verify went on waiting on a dead rank"


def test_verify_refuses_a_manifest_changed_after_signing(kiln_main, exported, tp2_store_copy):
    from kiln.store import open_store

    r = exported["cold_report"]
    store = open_store(tp2_store_copy["store"])
    forged = store.get_json(r["manifest"])
    forged["recipe"]["verify_atol"] = 1.0  # through the store's own API: its digests stay consistent
    store.put_json(r["manifest"], forged, overwrite=True)
    v = kiln_main("verify", "--store", tp2_store_copy["store"], r["export_id"])  # refused before any rank runs
    assert v.code == 1, v.err[-2000:]
    assert "changed after it was signed" in v.err and "Traceback" not in v.err
    assert "sha256 ok" not in v.out and "ranks together" not in v.out


def test_plan_prints_the_decision_without_compiling(kiln_main, exported, tmp_path):
    p = kiln_main("plan", "--model", "tiny", "--tp", "2", "--store", exported["store"])
    assert p.code == 0, p.err
    assert "gate: nothing_to_do" in p.out
    refused = kiln_main("plan", "--model", "tiny", "--tp", "2", "--store", f"file://{tmp_path / 'empty'}",
                   "--policy", "fail", "--set", "headroom_floor_mib=10000000")
    assert refused.code == 3
    assert "MiB short" in refused.out and "headroom_floor_mib" in refused.out


def test_export_refused_by_gate_exits_3_and_leaves_nothing_behind(kiln, tmp_path):
    import uuid

    from procmarks import wait_gone

    report, mark = tmp_path / "r.json", uuid.uuid4().hex
    run = kiln("export", "--model", "tiny", "--tp", "2", "--store", f"file://{tmp_path / 's'}",
               "--set", "headroom_floor_mib=10000000", "--set", "flow_retries=0", "--report", str(report),
               env={"TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"), "KILN_CACHE_DIR": str(tmp_path / "cache"),
                    "KILN_TEST_MARK": mark})
    assert run.code == 3, run.err[-2000:]
    assert "MiB short" in run.err and "Traceback" not in run.err
    r = json.loads(report.read_text())
    assert r["status"] == "failed" and r["gate"]["decision"] == "refused" and r["attempt"] == 1
    assert "MiB short" in r["error"]
    # Nothing compiled, nothing cached, nothing left running.
    assert [p["name"] for p in r["phases"]][-1] == "gate" and not any(p["name"] == "compile" for p in r["phases"])
    assert not list((tmp_path / "s").rglob("*.pt2"))
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and "forwards" in p.parts]
    assert not (tmp_path / "inductor").exists() or not [p for p in (tmp_path / "inductor").rglob("*") if p.is_file()]
    assert wait_gone(mark, timeout_s=30) == [], "processes of the refused export outlived it"


def test_export_refuses_a_corrupted_stored_artifact(kiln, kiln_env, exported, tp2_store_copy, tmp_path):
    """A host that must download a forward whose stored bytes no longer match their sha256 stops, naming it.
    (A fresh KILN_HOME, so a fresh host cache, trusting the exporting user's key.)"""
    r = exported["cold_report"]
    victim = r["forwards"][1]
    blob = (tp2_store_copy["root"] / victim["object"]).resolve()
    good = blob.read_bytes()
    blob.write_bytes(good[:-100] + b"\0" * 100)
    run = kiln("export", "--model", "tiny", "--tp", "2", "--store", tp2_store_copy["store"],
               "--report", str(tmp_path / "r.json"),
               env={"KILN_HOME": str(tmp_path / "fresh-host"),
                    "KILN_VERIFY_KEY": str(Path(kiln_env["KILN_HOME"]) / "keys" / "dev-signing.pub")})
    assert run.code == 1, run.err[-2000:]
    assert victim["key"] in run.err or victim["object"] in run.err
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["status"] == "failed" and report["manifest"] is None
    assert report["attempt"] == 1, "an integrity failure was retried"
    # Never loaded: the corrupt bytes did not reach the host's cache.
    assert not list((tmp_path / "fresh-host").rglob(f"{victim['key']}.pt2"))


def test_a_new_kv_plan_reuses_every_forward(kiln, exported, tp2_store_copy, tmp_path):
    """Forward keys leave the KV page count out: fewer pages, the same forwards."""
    cold = exported["cold_report"]
    fewer = cold["kv_plan"]["pages_per_rank"] // 2
    run = kiln("export", "--model", "tiny", "--tp", "2", "--store", tp2_store_copy["store"], "--set",
               f"kv_max_pages={fewer}", "--report", str(tmp_path / "r.json"))
    assert run.code == 0, run.err[-2000:]
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["kv_plan"]["pages_per_rank"] == fewer
    assert r["counts"]["compiled"] == 0
    assert {f["key"] for f in r["forwards"]} == {f["key"] for f in cold["forwards"]}


def test_verification_is_remembered_until_the_checkpoint_changes(kiln, kiln_main, exported, tp2_store_copy,
                                                                  tmp_path):
    cold, warm = exported["cold_report"], exported["warm_report"]
    name = cold["hosts"][0]["name"]
    assert (cold["hosts"][0]["verify_memory"]["predicted_mib"] or 0) > 0  # checked against eager
    assert warm["hosts"][0]["verify_memory"] == {"predicted_mib": None, "peak_mib": None}  # nothing re-checked
    assert set(warm["verify"][name]) == set(cold["verify"][name]) and len(cold["verify"][name]) == 2 * 2  # ranks x forwards
    # Same shapes (the tiny model's), other weights: the same forward keys, but every check runs again.
    ckpt = tmp_path / "other-weights"
    assert kiln_main("checkpoint", str(ckpt), "--seed", "7").code == 0
    run = kiln("export", "--model", str(ckpt), "--tp", "2", "--store", tp2_store_copy["store"],
               "--report", str(tmp_path / "r.json"))
    assert run.code == 0, run.err[-2000:]
    r = json.loads((tmp_path / "r.json").read_text())
    assert r["counts"]["compiled"] == 0 and {f["key"] for f in r["forwards"]} == {f["key"] for f in cold["forwards"]}
    assert (r["hosts"][0]["verify_memory"]["predicted_mib"] or 0) > 0, "a changed checkpoint was not checked again"
    checks = r["verify"][name]
    assert len(checks) == 4 and all(c["diff"] <= c["limit"] for c in checks.values())
    assert checks != warm["verify"][name]  # measured on the new weights, not remembered from the old
    from kiln.core.forwards.shape_ranges import parse_shape_range

    for which, c in checks.items():  # the worst of each range's checked shapes, every one of them compared
        shapes = parse_shape_range(which.split("/", 1)[1]).checked_shapes()
        assert c["at"] in {str(s) for s in shapes} and c["shapes"] == len(shapes), (which, c)
    # The manifest records the directory's files as the check read them: names, sizes and digests.
    import hashlib

    manifest = json.loads((tp2_store_copy["root"] / r["manifest"]).read_text())
    files = manifest["model"]["checkpoint_identity"]["files"]
    assert [f["name"] for f in files] == sorted(p.name for p in ckpt.iterdir())
    assert all(f["sha256"] == hashlib.sha256((ckpt / f["name"]).read_bytes()).hexdigest() for f in files)
    # Another tolerance decides checks anew: none is remembered from the checks under the default one.
    again = kiln("export", "--model", str(ckpt), "--tp", "2", "--store", tp2_store_copy["store"],
                 "--set", "verify_atol=0.002", "--report", str(tmp_path / "r2.json"))
    assert again.code == 0, again.err[-2000:]
    r2 = json.loads((tmp_path / "r2.json").read_text())
    assert (r2["hosts"][0]["verify_memory"]["predicted_mib"] or 0) > 0, "a check under other settings was remembered"
    assert not any(c.get("remembered") for c in r2["verify"][name].values())
    # `kiln verify` refuses the export's checkpoint once its weights changed, naming the file.
    assert kiln_main("checkpoint", str(ckpt), "--seed", "8").code == 0
    refused = kiln("verify", r["export_id"], "--store", tp2_store_copy["store"], "--model", str(ckpt))
    assert refused.code == 2 and "is not the one exported: model.safetensors was" in refused.err, refused.err[-2000:]


def test_a_stale_lease_of_a_dead_export_is_taken_over(kiln, kiln_env, exported, tmp_path):
    """A key leased by an export that died long ago is compiled at once, not waited for."""
    import time

    from kiln.core.run.leases import new_lease
    from kiln.core.trust.layout import lease_key
    from kiln.host.phases.host_compile import lease_scope
    from kiln.host.trust.signers import dev_key
    from kiln.store import LocalStore

    f = next(f for f in exported["cold_report"]["forwards"] if f["shapes"] == "1x16")
    store = LocalStore(tmp_path / "store")
    # The dead export signed with this user's development key: its lease is in this export's scope.
    scope = lease_scope(dev_key(Path(kiln_env["KILN_HOME"]))[0])
    store.put_json(lease_key(f["key"], scope, 0), new_lease("dead-export:host-x", time.time() - 3600, 60))
    run = kiln("export", "--model", "tiny", "--tp", "2", "--buckets", "1x16", "--store", f"file://{tmp_path / 'store'}",
               "--report", str(tmp_path / "r.json"))
    assert run.code == 0, run.err[-2000:]
    r = json.loads((tmp_path / "r.json").read_text())
    assert [x["key"] for x in r["forwards"]] == [f["key"]] and r["counts"]["compiled"] == 1
    assert r["hosts"][0]["waited_for_lease"] == []
    assert store.list("leases/") == [], "the taken-over lease was not released"


def test_worker_peaks_are_measured_and_the_next_plan_uses_them(kiln_main, exported):
    r = exported["cold_report"]
    assert all(f["compile_peak_mib"] > 100 for f in r["forwards"]), "each compile records its worker's peak"
    host = r["hosts"][0]
    assert host["worker_mib_source"] == "estimate" and host["worker_mib"] == 1024  # nothing measured yet
    assert host["compile_memory"]["min_available_mib"] > 0
    assert any(m["phase"] == "compile (lowest)" for m in host["memory"])
    warm = exported["warm_report"]["hosts"][0]
    peak = max(f["compile_peak_mib"] for f in r["forwards"])
    assert warm["worker_mib_source"] == "measured" and warm["worker_mib"] == math.ceil(peak * 1.15)
    # A new bucket of the same graph is planned with the measured figure too.
    planned = kiln_main("plan", "--model", "tiny", "--tp", "2", "--store", exported["store"], "--buckets", "16x16")
    assert planned.code == 0, planned.err[-2000:]
    assert f"{warm['worker_mib']} (measured)" in planned.out
    # ... and its time from the static compiles measured for the graph (the recipe's 30 s only before any).
    import statistics

    from kiln.store import open_store

    store = open_store(exported["store"])
    records = [store.get_json(o)["body"] for o in store.list("memory/")]  # signed by the export (signed_record)
    static = [m["compile_s"] for m in records if "-" not in m["shapes"]]
    assert static and f"about {statistics.median(static):.0f} s" in planned.out, planned.out
