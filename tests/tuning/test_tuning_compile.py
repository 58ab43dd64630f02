"""The tuning mechanism for real: measure, store, reuse, and a compile worker that benchmarks nothing.

CPU forwards cannot use what CPU max-autotune offers besides ATen (the C++
GEMM templates prepack weights at compile time; see kiln.core.plan.tuning_plan), so the tune
phase of a CPU export measures nothing. These tests measure CPU's ATen and
C++ candidates explicitly (backends 'ATEN,CPP') to check the mechanism every
tuned target relies on, and keep checking why CPU forwards do not use it: if a
torch release stops baking weights, `test_compile_uses_stored_choices...`
shows it and WEIGHTLESS_GEMM_BACKENDS can admit 'CPP'.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import subprocess
import sys
import textwrap
import time

import pytest

from kiln.core.plan import tuning_plan
from kiln.core.model.config import TINY
from kiln.core.plan.job import ExportJob
from kiln.core.plan.recipe import Recipe, parse_buckets
from kiln.host.machine import probe
from kiln.host.compile import tuner
from kiln.host.compile.compiler import CompilePool
from kiln.host.compile.inductor_options import compiler_options
from kiln.core.trust import signing
from kiln.store import open_store

pytestmark = pytest.mark.slow
B = "ATEN,CPP"
SIGNER = signing.generate()
"""The key these tuning runs sign their results with (KILN_SIGNING_KEY): only signed results are applied."""
FP = signing.fingerprint(SIGNER.public_key())


def job_for(tmp, mode: str) -> ExportJob:
    # 1x16 and 2x8 both have 16 rows: two forwards, six distinct GEMM shapes to measure.
    return ExportJob(export_id="t", model_name="tiny", checkpoint=str(tmp / "none"), config=dataclasses.asdict(TINY),
                     tp=2, recipe=Recipe(buckets=parse_buckets("1x16,2x8"), tuning=mode),
                     store_url=f"file://{tmp / 'store'}", signing=signing.SigningPlan("env", FP))


@pytest.fixture(scope="module", autouse=True)
def signing_key(tmp_path_factory):
    import base64

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KILN_SIGNING_KEY", base64.b64encode(SIGNER.private_bytes_raw()).decode())
        mp.setenv("KILN_HOME", str(tmp_path_factory.mktemp("home")))
        mp.delenv("KILN_VERIFY_KEY", raising=False)
        yield


@pytest.fixture(scope="module")
def tuned(tmp_path_factory, signing_key):
    """A cold tuning run and an identical warm one on a fresh store."""
    tmp = tmp_path_factory.mktemp("tuned")
    job, target = job_for(tmp, "cached"), probe.target_fingerprint()
    start = time.perf_counter()
    cold = tuner.tune_target(job, target, backends=B)
    cold_s = time.perf_counter() - start
    start = time.perf_counter()
    warm = tuner.tune_target(job, target, backends=B)
    warm_s = time.perf_counter() - start
    return {"tmp": tmp, "job": job, "target": target, "cold": cold, "warm": warm, "cold_s": cold_s,
            "warm_s": warm_s}


def stored(t) -> dict:
    store = open_store(t["job"].store_url)
    return {k: json.loads(store.get_bytes(k))["body"] for k in store.list("tuning/")}  # signed records


def test_cold_run_measures_every_candidate_warm_run_nothing(tuned):
    cold, warm = tuned["cold"], tuned["warm"]
    assert (cold["status"], cold["shapes"], cold["hits"], cold["misses"], cold["changed"]) == ("ok", 6, 0, 6, True)
    results = stored(tuned)
    assert len(results) == 6
    # Candidates benchmarked (Inductor's counter) = timings stored: every shape's ATen and C++ candidates.
    assert cold["measured"] == sum(tuning_plan.count_timings(r["entries"]) for r in results.values()) >= 12
    assert (warm["measured"], warm["hits"], warm["misses"], warm["changed"]) == (0, 6, 0, False)
    assert warm["measure_s"] == 0 and tuned["warm_s"] < tuned["cold_s"] / 10


def test_compile_uses_stored_choices_without_benchmarking(tuned, tmp_path, monkeypatch):
    """A compile worker with an empty Inductor cache, given the stored results, benchmarks nothing,
    and the package holds exactly the C++ kernels the stored results chose: one prepacked weight
    constant per GEMM whose winner is a C++ template, which no rank's weights can fill."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # inherited by the spawned worker
    job, target = tuned["job"], tuned["target"]
    store = open_store(job.store_url)
    import torch

    found = tuner.lookup(store, job, target, torch.__version__, B)
    spec = job.specs(target=target, torch_version=torch.__version__, code="test", compiler=compiler_options(B),
                     tuning=found)[0]
    entries = tuner.load_for_compile(store, [spec], torch.__version__, {FP: SIGNER.public_key()})
    with CompilePool(1, tuning_entries=entries) as pool:  # a worker gets the spec as plain data
        [result] = pool.run([(spec.to_dict(), str(tmp_path / "f.pt2"))], lambda r: None)
    from kiln.core.model.contract import constant_shapes

    # The GEMMs Inductor autotunes: with the layers one scan, only the output head. torch 2.13's Inductor
    # lowers the scan's body without algorithm selection (measured: 1 selection where the unrolled model
    # had 15), so the layers' projections compile with ATen whatever was tuned (docs/tuning.md).
    head = constant_shapes(TINY, 2)["lm_head.weight"]
    linears = collections.Counter({(head[1], head[0]): 1})
    assert result.autotune["selections"] == sum(linears.values()) == 1
    assert result.autotune["benchmarked"] == 0
    assert result.autotune["tuning_timings"] == tuning_plan.count_timings(entries)
    chosen = {}
    for r in stored(tuned).values():
        [win] = [c for ins in tuning_plan.winners(r["entries"]).values() for p in ins.values() for c in p.values()]
        chosen[(r["shape"]["k"], r["shape"]["n"])] = win
    cpp_gemms = sum(n for kn, n in linears.items() if chosen[kn].startswith("Cpp"))
    loaded = _load_with_rank_weights(result.path)
    assert loaded["extra_constants"] == cpp_gemms, (chosen, loaded)
    assert (loaded["error"] is not None) == (cpp_gemms > 0), loaded
    if cpp_gemms:  # Kiln's loader names the cause instead of AOTInductor's bare RuntimeError
        from kiln.core.errors import KilnError
        from kiln.host.ranks.loader import load_forward
        from kiln.host.model import random_state_dict, shard_state_dict

        weights = shard_state_dict(random_state_dict(TINY), TINY, 2, 0)
        with pytest.raises(KilnError, match=f"needs {cpp_gemms} constant"):
            load_forward(result.path, weights, result.sha256)


def _load_with_rank_weights(path: str) -> dict:
    """In a fresh process: the package's constants beyond a rank's weights, and whether the weights load."""
    code = textwrap.dedent(f"""
        import json, torch
        import kiln.host.model
        from kiln.core.model.config import TINY
        from kiln.host.ranks.loader import _compact
        weights = kiln.host.model.shard_state_dict(kiln.host.model.random_state_dict(TINY), TINY, 2, 0)
        package = torch._inductor.aoti_load_package({path!r})
        names = set(package.get_constant_fqns())
        error = None
        try:
            package.load_constants({{n: _compact(t) for n, t in weights.items() if n in names}}, check_full_update=True)
        except RuntimeError as exc:
            error = str(exc)[:200]
        print(json.dumps({{"extra_constants": len(names - set(weights)), "error": error}}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_full_measures_everything_again_and_replaces(tuned):
    before = {k: r["run"] for k, r in stored(tuned).items()}
    job = dataclasses.replace(tuned["job"], recipe=dataclasses.replace(tuned["job"].recipe, tuning="full"))
    full = tuner.tune_target(job, tuned["target"], backends=B)
    assert (full["status"], full["hits"], full["misses"], full["changed"]) == ("ok", 0, 0, True)
    assert full["measured"] >= 12
    after = stored(tuned)
    assert set(after) == set(before) and all(after[k]["run"] != before[k] for k in after)
