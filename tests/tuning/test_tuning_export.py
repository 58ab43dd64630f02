"""Two exports in a row through the real flow, with tuning forced onto CPU's C++ GEMM candidates.

A CPU export measures nothing (weightless forwards cannot use the C++
templates; see kiln.core.plan.tuning_plan). To run the flow's tuning path for real on this
CPU machine, the flow runs in a subprocess that admits 'CPP' for CPU forwards
first (in this process: one local host, so the tasks run here and see it).
What it shows:

- tuning runs once for the target, measures every candidate of a fresh
  store, and the next export measures nothing, quickly (that several hosts of
  one target tune once is kiln.core.plan.tuning_plan.tuning_hosts, unit-tested);
- the compile workers, given the stored results, autotune every GEMM and
  benchmark nothing;
- the forwards then carry C++ kernels whose prepacked weights no rank can
  supply, and share-verify refuses them (why CPU forwards are not tuned);
  had ATen won every GEMM they would load and match eager instead.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.slow

RUN_FLOW = textwrap.dedent("""
    import json, sys
    from kiln.core.plan import tuning_plan
    tuning_plan.WEIGHTLESS_GEMM_BACKENDS["cpu"] = ("ATEN", "CPP")  # what CPU forwards must not use (see module doc)
    from flows.export import export
    from flows.params import ExportParams
    from kiln.core.errors import KilnError
    params = ExportParams(**json.loads(sys.argv[1]))
    try:
        export(**params.flow_parameters())
    except KilnError as exc:  # expected when the tuned forwards cannot be verified (see the last test)
        print("KILN-OUTCOME " + json.dumps({"error": type(exc).__name__}))
        sys.exit(1)
    print("KILN-OUTCOME " + json.dumps({"error": None}))
""")


def outcome(run: subprocess.CompletedProcess) -> dict:
    """The flow's outcome as the script printed it; any other exception is a crash and fails here."""
    lines = [line for line in run.stdout.splitlines() if line.startswith("KILN-OUTCOME ")]
    assert lines and run.returncode in (0, 1), (run.returncode, run.stderr[-3000:])
    got = json.loads(lines[-1].removeprefix("KILN-OUTCOME "))
    assert (got["error"] is None) == (run.returncode == 0)
    return got


@pytest.fixture(scope="module")
def two_exports(tmp_path_factory, prefect_server):
    """Two exports of one bucket (one forward: the tuning covers its GEMM shapes, and one compile shows
    what the compile workers do with the stored results), reporting to the session's Prefect server."""
    d = tmp_path_factory.mktemp("tuned-export")
    env = {**os.environ, "KILN_HOME": str(d / "home"), "PREFECT_HOME": str(d / "prefect"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_API_URL": prefect_server,
           "TORCHINDUCTOR_CACHE_DIR": str(d / "inductor"), "PYTHONUNBUFFERED": "1"}  # no autotune entries yet
    reports = []
    for name in ("first", "second"):
        params = {"model": "tiny", "tp": 2, "store": f"file://{d / 'store'}", "export_id": f"tuned-{name}",
                  "recipe": {"buckets": "1x16", "flow_retries": 0}, "report": str(d / f"{name}.json")}
        run = subprocess.run([sys.executable, "-c", RUN_FLOW, json.dumps(params)], env=env, capture_output=True,
                             text=True, timeout=1500)
        assert (d / f"{name}.json").exists(), run.stderr[-3000:]
        reports.append({**json.loads((d / f"{name}.json").read_text()), "outcome": outcome(run)})
    return {"dir": d, "first": reports[0], "second": reports[1]}


def tune_phase(report):
    return next(p for p in report["phases"] if p["name"] == "tune")


def test_first_export_measures_once(two_exports):
    r = two_exports["first"]
    tune = tune_phase(r)
    assert tune["status"] == "ok" and len(tune["runs"]) == 1, "one tuning run for the target"
    assert (tune["hits"], tune["misses"]) == (0, 6)
    assert r["counts"]["tuning_measured"] == tune["measured"] >= 12
    assert [m["phase"] for m in r["hosts"][0]["memory"]][:3] == ["start", "probe", "tune"]
    assert len(r["hosts"]) == 1


def test_second_export_measures_nothing_and_tunes_quickly(two_exports):
    first, second = two_exports["first"], two_exports["second"]
    tune = tune_phase(second)
    assert second["counts"]["tuning_measured"] == 0 and (tune["hits"], tune["misses"]) == (6, 0)
    assert tune["duration_s"] < tune_phase(first)["duration_s"] / 10
    assert {f["key"] for f in second["forwards"]} == {f["key"] for f in first["forwards"]}
    assert second["counts"]["compiled"] == 0


def test_compile_workers_used_the_stored_choices(two_exports):
    forwards = two_exports["first"]["forwards"]
    assert len(forwards) == 1 and all(f["tuning"] for f in forwards)
    for f in forwards:
        # Only the output head: Inductor lowers the scanned layer body without algorithm selection
        # (docs/tuning.md; the unrolled forward autotuned all 15 linears).
        assert f["autotune"]["selections"] == 1, "the output head's GEMM was autotuned"
        assert f["autotune"]["benchmarked"] == 0, "from the stored results, without benchmarking"


def test_share_verify_refuses_forwards_with_prepacked_weights(two_exports):
    r = two_exports["first"]
    store = two_exports["dir"] / "store"
    from kiln.core.model.config import TINY
    from kiln.core.plan.tuning_plan import winners

    # The output head is the one GEMM the compile autotunes (see above): only its winner reaches a forward.
    runs = [json.loads(p.read_text())["body"] for p in (store / "tuning").rglob("*.json")]  # signed records
    head = [run for run in runs if (run["shape"]["k"], run["shape"]["n"]) == (TINY.hidden_size, TINY.vocab_size)]
    assert head, "the output head's GEMM was measured"
    cpp = any(w.startswith("Cpp")
              for run in head
              for ins in winners(run["entries"]).values()
              for precs in ins.values() for w in precs.values())
    verify = next(p for p in r["phases"] if p["name"] == "share-verify")
    if cpp:
        assert r["status"] == "failed" and verify["status"] == "failed"
        assert r["outcome"]["error"] == "UnloadablePackage"
        assert "no rank's weights provide" in r["error"] and "C++ GEMM templates" in r["error"], r["error"]
    else:  # ATen won every GEMM: the forwards hold no prepacked weights and match eager
        assert r["outcome"]["error"] is None
        assert r["status"] == "completed" and max(c["diff"] for v in r["verify"].values() for c in v.values()) < 1e-3
