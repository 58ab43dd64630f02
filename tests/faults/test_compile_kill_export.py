"""Fault 1 end to end: a compile worker SIGKILLed mid-compile during a real export.

KILN_FAULT_KILL_COMPILE (kiln/host/processes/faults.py) makes the worker kill itself at a
chosen point, a fixed number of times (markers in KILN_FAULT_DIR), so the
fault is deterministic whatever the scheduling.
"""

from __future__ import annotations

import hashlib
import json
import re

import pytest
from kiln_faults import fired

from kiln.store import open_store

pytestmark = pytest.mark.slow


def run_export(kiln, tmp_path, kill: str, *extra: str):
    store = tmp_path / "store"
    env = {"KILN_FAULT_KILL_COMPILE": kill, "KILN_FAULT_DIR": str(tmp_path / "markers"),
           "KILN_CACHE_DIR": str(tmp_path / "cache")}
    run = kiln("export", "--tp", "2", "--buckets", "1x8,2x8", "--store", f"file://{store}",
               "--report", str(tmp_path / "r.json"), *extra, env=env)
    report = json.loads((tmp_path / "r.json").read_text())
    return run, report, store


def test_export_completes_when_a_worker_dies_after_writing_its_package(kiln, tmp_path):
    run, r, store = run_export(kiln, tmp_path, "1x8:1:written")
    assert run.code == 0, run.err[-3000:]
    assert len(fired(tmp_path / "markers")) == 1  # the fault happened, once
    attempts = {f["shapes"]: f["compile_attempts"] for f in r["forwards"]}
    assert attempts == {"1x8": 2, "2x8": 1}  # only the killed forward was compiled again
    assert r["counts"]["compiled"] == 2 and r["status"] == "completed"
    for f in r["forwards"]:  # nothing lost, nothing partial: every artifact whole in the store
        assert hashlib.sha256((store / f["object"]).read_bytes()).hexdigest() == f["sha256"]
    # The dead worker's half-published file was cleaned up, never uploaded.
    assert not list((tmp_path / "cache").rglob("*.tmp-*.pt2"))
    assert sorted(p.relative_to(store).as_posix() for p in (store / "forwards").rglob("*.pt2")) \
        == sorted(f["object"] for f in r["forwards"])


def test_a_forward_that_keeps_killing_its_worker_fails_naming_it_and_keeps_the_rest(kiln, tmp_path):
    run, r, store = run_export(kiln, tmp_path, "2x8:9", "--set", "max_compile_attempts=2", "--set", "flow_retries=0")
    assert run.code == 1, run.err[-3000:]
    assert len(fired(tmp_path / "markers")) == 2  # bounded by max_compile_attempts
    assert "(2x8) killed its compile worker 2 times (max_compile_attempts=2" in run.err
    assert "Traceback" not in run.err.split("kiln: ")[-1]
    assert r["status"] == "failed" and "2x8" in r["error"]
    # The forward that finished is in the store, whole: it will not be compiled again on a re-run.
    killed = re.search(r"forward ([0-9a-f]{32}) \(2x8\)", run.err).group(1)
    store_api = open_store(f"file://{store}")
    stored = store_api.list("forwards/")
    assert len(stored) == 1 and killed not in stored[0]
    store_api.get_bytes(stored[0])  # verified against its recorded sha256
    assert not [k for k in store_api.list("exports/") if k.endswith("manifest.json")]  # none for a failed export
