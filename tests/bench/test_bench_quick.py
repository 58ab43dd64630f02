"""Smoke test of `kiln bench --quick PARTS`: it runs and writes every figure of its parts as a finite number.

No thresholds: the figures depend on the machine and its load. This only
checks that the suite works end to end from the CLI, on the quick parts whose
compiles the rest of the suite does not already make. Left out (SMOKE_SKIPS):
compile_efficiency and the parts that read its runs, warm_cold among them (a cold
and a warm export as the session's tp2_export fixture makes them, a compile loop
and a direct compile: 109 s alone; warm_cold's share, the two exports and the
embedded API's start-up, 70 s alone of this test's 209 s), and depth (four
compiles of the tiny model: 64 s alone); together about two thirds of the quick
bench's time. `kiln bench --quick` and the committed full runs measure them; that
a warm export compiles and checks nothing again is tests/integration/test_export.py's
(tp2_export's warm run).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from bench.figures import FIGURES
from bench.suite import select

SMOKE_SKIPS = ("compile_efficiency", "pool_vs_loop", "dedup", "warm_cold", "overhead", "depth")
SMOKE_PARTS = [p for p in select([], quick=True) if p not in SMOKE_SKIPS]

pytestmark = pytest.mark.slow


@pytest.mark.timeout(3600)  # pytest's own limit (pyproject: 1500 s) stopped it first on a loaded CI machine
def test_quick_bench_writes_figures(tmp_path):
    # The timeout catches a hang, not slowness: the quick bench took 540 s with the suite's other worker busy
    # on an idle machine, and 1495 s on a loaded one (a 1800 s limit then stopped it while it drew its chart).
    env = {**os.environ, "KILN_HOME": str(tmp_path / "home"), "PREFECT_HOME": str(tmp_path / "prefect")}
    env.pop("PREFECT_API_URL", None)
    run = subprocess.run([sys.executable, "-m", "cli.main", "bench", "--quick", *SMOKE_PARTS,
                          "--out", str(tmp_path / "results")],
                         env=env, capture_output=True, text=True, timeout=3600, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-4000:]
    (result_json,) = (tmp_path / "results").glob("*.json")
    result = json.loads(result_json.read_text())
    assert result["mode"] == "quick" and not result["errors"]
    parts = SMOKE_PARTS
    assert result["parts"] == parts and "fail_fast" in parts
    expected = {name for name, (part, _) in FIGURES.items() if part in parts}
    assert expected <= set(result["figures"])
    for name in expected:
        value = result["figures"][name]
        assert isinstance(value, (int, float)) and math.isfinite(value), (name, value)
    # What the refused run left behind, as the bench measured it: it stopped at the gate, compiled nothing.
    (fail_fast,) = result["raw"]["fail_fast"]["samples"]  # quick: one sample
    evidence = fail_fast["evidence"]
    assert evidence["phases"] == ["probe", "tune", "kv-plan", "gate"] and evidence["gate_decision"] == "refused"
    assert (evidence["forwards_in_store"], evidence["pt2_in_host_caches"], evidence["inductor_cache_files"]) == (0, 0, 0)
    # The compile-first baseline did compile: the evidence counters see compiled work where there is some.
    assert fail_fast["baseline"]["failed"] and fail_fast["baseline_wall_s"] > 0
    assert evidence["baseline_forwards_in_store"] > 0
    assert result_json.with_suffix(".md").exists() and result_json.with_suffix(".png").exists()
    assert "| figure | value | target | met |" in run.stdout
