"""Tuning results in a real store: lookup, verification, signed by the export that measured them and applied only
when a trusted key signed them, never applied elsewhere, installed into Inductor.

No compilation here; the measured results are hand-made entries in Inductor's
format. tests/tuning/test_tuning_compile.py measures for real.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kiln.core.plan import tuning_plan
from kiln.core.model.config import TINY
from kiln.core.errors import IntegrityError, KilnError
from kiln.core.forwards.forward_keys import ForwardSpec
from kiln.core.plan.job import ExportJob
from kiln.core.plan.recipe import Recipe, parse_buckets
from kiln.host.compile import tuner
from kiln.host.compile.inductor_options import compiler_options
from kiln.core.trust import signing
from kiln.core.trust.signed_record import sign_record
from kiln.store import open_store

T, V, B = "cpu-x86_64-avx512-test", "2.13.0+cpu", "ATEN,CPP"
SIGNER = signing.generate()
"""The key the tests' exports sign with (KILN_SIGNING_KEY), so their tuning results are trusted."""
FP = signing.fingerprint(SIGNER.public_key())
TRUSTED = {FP: SIGNER.public_key()}


@pytest.fixture(autouse=True)
def signing_key(monkeypatch, tmp_path):
    import base64

    monkeypatch.setenv("KILN_SIGNING_KEY", base64.b64encode(SIGNER.private_bytes_raw()).decode())
    monkeypatch.setenv("KILN_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("KILN_VERIFY_KEY", raising=False)


def make_job(tmp_path: Path, buckets: str = "1x16,2x8,4x8", tuning_mode: str = "cached",
             signed: bool = True) -> ExportJob:
    return ExportJob(export_id="t", model_name="tiny", checkpoint=str(tmp_path / "none"),
                     config=dataclasses.asdict(TINY), tp=2,
                     recipe=Recipe(buckets=parse_buckets(buckets), tuning=tuning_mode, shape_policy="static"),
                     store_url=f"file://{tmp_path / 'store'}",
                     signing=signing.SigningPlan("env", FP) if signed else signing.SigningPlan("off"))


def fake_run(shapes, *, cpp_ms: float = 0.01) -> dict:
    """What `tuner.measure` returns, with one ATen and one C++ candidate per shape."""
    results = {str(s): {"mm": {f"[('cpu', 'torch.float32', {s.m}, {s.k}), ({s.k}, {s.n})]": {
        "highest": {"mm-aten": 0.02, "CppMicroGemmFP32Vec-x": cpp_ms}}}} for s in shapes}
    return {"results": results, "benchmarked": 2 * len(shapes), "measure_s": 1.0, "selections": len(shapes)}


def save(store, shapes, *, replace=False, cpp_ms=0.01):
    decision = tuning_plan.TuningDecision(measure=tuple(shapes), hits=(), replace=replace)
    tuner._save(store, fake_run(shapes, cpp_ms=cpp_ms), decision, target=T, torch_version=V, backends=B,
                signer=SIGNER)


def specs(job, found) -> dict[str, ForwardSpec]:
    return {str(s.shapes): s for s in job.specs(
        target=T, torch_version=V, code="c", compiler=compiler_options(B), tuning=found)}


def rows16(job):
    return tuning_plan.export_shapes(job.model_config, job.tp, job.recipe.shapes)["1x16"]


def test_lookup_gives_each_bucket_its_results_and_digest(tmp_path):
    job = make_job(tmp_path)
    store = open_store(job.store_url)
    save(store, rows16(job))  # 1x16 and 2x8 share these 6 shapes; 4x8 (32 rows) has none stored
    found = tuner.lookup(store, job, T, V, B)
    assert found["1x16"]["missing"] == 0 and len(found["1x16"]["objects"]) == 6
    assert found["1x16"]["digest"] == found["2x8"]["digest"] is not None
    assert found["4x8"] == {"digest": None, "objects": [], "missing": 6}
    by_bucket = specs(job, found)
    entries = tuner.load_for_compile(store, [by_bucket["1x16"], by_bucket["2x8"]], V, TRUSTED)
    assert tuning_plan.count_timings(entries) == 12
    with pytest.raises(KilnError, match="lacks tuning results for 6 GEMM shape"):
        tuner.load_for_compile(store, [by_bucket["4x8"]], V, TRUSTED)
    assert tuner.load_for_compile(store, [dataclasses.replace(by_bucket["1x16"], tuning=None)], V, TRUSTED) is None
    with pytest.raises(IntegrityError, match="not signed by a key this export trusts"):
        tuner.load_for_compile(store, [by_bucket["1x16"]], V, {})


def test_only_results_a_trusted_key_signed_are_applied(tmp_path, monkeypatch):
    """Anyone who can write the store could choose the next export's kernels: an unsigned result, or one
    signed by a key the export does not trust, counts as not measured."""
    job = make_job(tmp_path, buckets="1x16")
    store = open_store(job.store_url)
    shape = rows16(job)[0]
    result = tuning_plan.build_result(target=T, torch_version=V, backends=B, shape=shape,
                                      entries=fake_run([shape])["results"][str(shape)], measured_by="x", run={})
    other = signing.generate()
    other_fp = signing.fingerprint(other.public_key())
    store.put_json(tuning_plan.object_key(T, V, B, shape, other_fp), sign_record("tuning", result, other))
    store.put_json(tuning_plan.object_key(T, V, B, shape, "ed25519:" + "0" * 32), result)  # unsigned, planted
    assert tuner.lookup(store, job, T, V, B)["1x16"]["missing"] == 6
    monkeypatch.setenv("KILN_VERIFY_KEY", base64.b64encode(signing.raw_public(other.public_key())).decode())
    assert tuner.lookup(store, job, T, V, B)["1x16"]["missing"] == 5  # trusting its signer: applied


def test_an_unsigned_export_tunes_nothing(tmp_path):
    job = make_job(tmp_path, signed=False)
    run = tuner.tune_target(job, T, backends=B)
    assert run["status"] == "skipped" and run["reason"] == tuner.UNSIGNED_REASON and not run["changed"]
    assert tuner.tuning_backends(job, "cuda") is None


def test_same_winners_same_key_other_winners_other_key(tmp_path):
    job = make_job(tmp_path, buckets="1x16")
    store = open_store(job.store_url)
    save(store, rows16(job), cpp_ms=0.01)
    first = specs(job, tuner.lookup(store, job, T, V, B))["1x16"]
    save(store, rows16(job), cpp_ms=0.015, replace=True)  # re-measured ('full'): C++ still wins
    again = specs(job, tuner.lookup(store, job, T, V, B))["1x16"]
    assert again.key == first.key and again.tuning["objects"] != first.tuning["objects"]
    save(store, rows16(job), cpp_ms=0.5, replace=True)  # now ATen wins every GEMM
    assert specs(job, tuner.lookup(store, job, T, V, B))["1x16"].key != first.key


def test_tampered_result_is_refused(tmp_path):
    job = make_job(tmp_path, buckets="1x16")
    store = open_store(job.store_url)
    save(store, rows16(job))
    spec = specs(job, tuner.lookup(store, job, T, V, B))["1x16"]
    key = spec.tuning["objects"][0]["key"]
    blob = (tmp_path / "store" / key).resolve()  # the bytes behind the store's key
    blob.write_bytes(blob.read_bytes().replace(b"0.02", b"0.99"))
    with pytest.raises(IntegrityError, match=key):
        tuner.lookup(store, job, T, V, B)
    with pytest.raises(IntegrityError, match=key):
        tuner.load_for_compile(store, [spec], V, TRUSTED)


def test_replaced_after_the_probe_is_refused(tmp_path):
    job = make_job(tmp_path, buckets="1x16")
    store = open_store(job.store_url)
    save(store, rows16(job))
    spec = specs(job, tuner.lookup(store, job, T, V, B))["1x16"]
    save(store, rows16(job), cpp_ms=0.5, replace=True)
    with pytest.raises(IntegrityError, match="replaced"):
        tuner.load_for_compile(store, [spec], V, TRUSTED)


def test_a_result_for_another_target_or_torch_is_never_applied(tmp_path):
    job = make_job(tmp_path, buckets="1x16")
    store = open_store(job.store_url)
    save(store, rows16(job))
    # Another torch version or target looks under other keys and finds nothing.
    assert tuner.lookup(store, job, T, "2.14.0+cpu", B)["1x16"]["missing"] == 6
    assert tuner.lookup(store, job, "cpu-x86_64-avx2-other", V, B)["1x16"]["missing"] == 6
    # Even copied under the other target's key, the result says what it is for and is refused.
    shape = rows16(job)[0]
    data = store.get_bytes(tuning_plan.object_key(T, V, B, shape, FP))
    store.put_bytes(tuning_plan.object_key("cpu-x86_64-avx2-other", V, B, shape, FP), data)
    with pytest.raises(tuning_plan.TuningMismatch, match="never applied"):
        tuner.lookup(store, job, "cpu-x86_64-avx2-other", V, B)


def test_racing_cached_writer_keeps_the_first_result(tmp_path):
    job = make_job(tmp_path, buckets="1x16")
    store = open_store(job.store_url)
    save(store, rows16(job), cpp_ms=0.01)
    before = store.stat(tuning_plan.object_key(T, V, B, rows16(job)[0], FP)).sha256
    save(store, rows16(job), cpp_ms=0.5)  # create-once: the first result of this signer stands
    assert store.stat(tuning_plan.object_key(T, V, B, rows16(job)[0], FP)).sha256 == before


def test_cpu_tune_phase_measures_nothing_and_says_why(tmp_path):
    for mode in ("cached", "full", "off"):
        run = tuner.tune_target(make_job(tmp_path, tuning_mode=mode), T)
        assert run["status"] == "skipped" and run["measured"] == 0 and not run["changed"]
        assert ("prepack" in run["reason"]) if mode != "off" else run["reason"] == "tuning is off"
    assert not (tmp_path / "store").exists(), "a skipped tune phase writes nothing"


def test_tuning_runs_only_on_a_host_of_its_target(tmp_path):
    with pytest.raises(KilnError, match="must run on a host of that target"):
        tuner.tune_target(make_job(tmp_path), "cpu-elsewhere", backends=B)


def test_install_merges_into_inductor_autotune_cache(tmp_path):
    """In a fresh process and Inductor cache dir: installed, idempotent, other entries kept."""
    entries = {"mm": {"k1": {"highest": {"mm-aten": 0.02, "CppMicroGemmFP32Vec-x": 0.01}}}}
    code = textwrap.dedent(f"""
        import json
        from torch._inductor.codecache import CacheBase
        from kiln.host.compile import tuner
        CacheBase().update_local_cache({{"mm": {{"other": {{"highest": {{"mm-aten": 1.0}}}}}}}})
        first = tuner.install({entries!r})
        second = tuner.install({entries!r})
        print(json.dumps([first, second, str(CacheBase.get_local_cache_path()), CacheBase().get_local_cache()]))
    """)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    first, second, path, cache = json.loads(out.stdout.strip().splitlines()[-1])
    assert (first, second) == (2, 0)
    assert path.startswith(str(tmp_path / "inductor"))
    assert cache["mm"]["k1"] == entries["mm"]["k1"] and cache["mm"]["other"] == {"highest": {"mm-aten": 1.0}}
