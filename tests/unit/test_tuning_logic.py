"""Kernel tuning's pure core: shapes, result ids, what to measure, digests, applicability."""

import pytest

from kiln.core.model.config import TINY
from kiln.core.forwards.forward_keys import forward_spec
from kiln.core.plan.probe_result import HostProbe
from kiln.core.plan.recipe import Bucket
from kiln.core.forwards.shape_ranges import parse_shape_range, static_shape
from kiln.core.plan.tuning_plan import (
    GemmShape,
    TuningMismatch,
    bucket_shapes,
    build_result,
    check_result,
    decide,
    distinct_shapes,
    export_shapes,
    gemm_backends,
    merge_entries,
    object_key,
    object_prefix,
    result_id,
    summarize,
    tuning_digest,
    tuning_hosts,
    untuned_reason,
    winners,
)
from kiln.host.compile.inductor_options import COMPILER_OPTIONS, compiler_options

T, V, B = "cpu-x86_64-avx512-1234", "2.13.0+cpu", "ATEN,CPP"
S16 = GemmShape(16, 384, 192, "float32")
S32 = GemmShape(32, 384, 192, "float32")


def result(shape=S16, *, aten=0.02, cpp=0.01, target=T, torch=V, inputs="[('cpu', 'torch.float32', 16)]"):
    entries = {"mm": {inputs: {"highest": {"mm-aaa": aten, "CppMicroGemmFP32Vec-bbb": cpp}}}}
    return build_result(target=target, torch_version=torch, backends=B, shape=shape, entries=entries,
                        measured_by="h", run={"benchmarked": 2})


def test_bucket_shapes_of_tiny_tp2():
    got = {(s.m, s.k, s.n) for s in bucket_shapes(TINY, 2, Bucket(1, 16))}
    # q 384->192, k/v 384->96 (one shape), o 192->384, gate/up 384->576, down 576->384, lm_head 384->1024
    assert got == {(16, 384, 192), (16, 384, 96), (16, 192, 384), (16, 384, 576), (16, 576, 384), (16, 384, 1024)}


def test_buckets_with_equal_rows_share_shapes():
    by_bucket = export_shapes(TINY, 2, (static_shape(Bucket(1, 16)), static_shape(Bucket(2, 8)),
                                        parse_shape_range("2-4x8-32")))
    assert by_bucket["1x16"] == by_bucket["2x8"]
    assert by_bucket["2-4x8-32@4x32"] == bucket_shapes(TINY, 2, Bucket(4, 32))  # a range is tuned at its hint
    assert len(distinct_shapes(by_bucket)) == 12


def test_result_id_depends_on_target_torch_backends_and_shape():
    base = result_id(T, V, B, S16)
    assert result_id(T, V, B, S16) == base
    assert result_id("cpu-x86_64-avx2-1234", V, B, S16) != base
    assert result_id(T, "2.14.0+cpu", B, S16) != base
    assert result_id(T, V, "ATEN,TRITON", S16) != base
    assert result_id(T, V, B, S32) != base
    assert result_id(T, V, B, GemmShape(16, 384, 192, "bfloat16")) != base
    assert object_key(T, V, B, S16, "ed25519:ab") == f"tuning/{base}/ed25519-ab.json"
    assert object_key(T, V, B, S16, "ed25519:ab").startswith(object_prefix(T, V, B, S16))


def test_weightless_cpu_forwards_have_nothing_to_tune():
    for mode in ("off", "cached", "full"):
        assert gemm_backends(mode, "cpu") is None
    assert "prepack" in untuned_reason("cached", "cpu") and "ATEN" in untuned_reason("cached", "cpu")
    assert untuned_reason("off", "cpu") == "tuning is off"
    assert gemm_backends("cached", "tpu") is None and "not verified" in untuned_reason("cached", "tpu")
    # Untuned forwards keep the options (and therefore the keys) of tuning off.
    assert compiler_options(None) == COMPILER_OPTIONS
    assert compiler_options("ATEN,TRITON")["max_autotune_gemm_backends"] == "ATEN,TRITON"
    with pytest.raises(ValueError):
        gemm_backends("sometimes", "cpu")


def test_decide_per_mode():
    wanted = (S32, S16, S16)
    assert decide("off", wanted, set()).measure == ()
    cached = decide("cached", wanted, {S16})
    assert cached.measure == (S32,) and cached.hits == (S16,) and not cached.replace
    assert decide("cached", wanted, {S16, S32}).measure == ()
    full = decide("full", wanted, {S16, S32})
    assert full.measure == (S16, S32) and full.hits == () and full.replace
    with pytest.raises(ValueError):
        decide("sometimes", wanted, set())


def test_a_result_for_another_target_or_torch_is_never_applied():
    r = result()
    check_result(r, target=T, torch_version=V, backends=B, shape=S16)
    with pytest.raises(TuningMismatch, match="never applied"):
        check_result(r, target="cpu-x86_64-avx2-1234", torch_version=V, backends=B, shape=S16)
    with pytest.raises(TuningMismatch, match="never applied"):
        check_result(r, target=T, torch_version="2.14.0+cpu", backends=B, shape=S16)
    with pytest.raises(TuningMismatch, match="backends"):
        check_result(r, target=T, torch_version=V, backends="ATEN,TRITON", shape=S16)
    with pytest.raises(TuningMismatch, match="shape"):
        check_result(r, target=T, torch_version=V, backends=B, shape=S32)


@pytest.mark.parametrize("bad", [
    {"format": 99}, {"entries": {}}, {"entries": []}, {"entries": {"mm": {"k": {"highest": {"c": "fast"}}}}},
    {"entries": {"mm": {"k": {"highest": {}}}}}, {"entries": {"mm": {"k": {"highest": {"c": True}}}}},
])
def test_malformed_results_are_refused(bad):
    r = {**result(), **bad}
    with pytest.raises(TuningMismatch):
        check_result(r, target=T, torch_version=V, backends=B)


def test_winners_pick_the_fastest_finite_choice():
    entries = {"mm": {"k1": {"highest": {"a": 2.0, "b": 1.0, "c": float("inf")}},
                      "k2": {"highest": {"a": float("nan"), "b": 3.0}}}}
    assert winners(entries) == {"mm": {"k1": {"highest": "b"}, "k2": {"highest": "b"}}}


def test_digest_follows_winning_kernels_not_timings():
    base = tuning_digest([result(aten=0.02, cpp=0.01)])
    assert tuning_digest([result(aten=0.03, cpp=0.015)]) == base, "re-measured, same choice: same digest"
    assert tuning_digest([result(aten=0.01, cpp=0.02)]) != base, "another kernel wins: another digest"
    two = [result(), result(S32, inputs="[('cpu', 'torch.float32', 32)]")]
    assert tuning_digest(two) == tuning_digest(list(reversed(two)))
    assert tuning_digest(two) != base


def test_merge_entries_unions_results():
    a, b = result(), result(S32, inputs="k32")
    merged = merge_entries([a, b])
    assert set(merged["mm"]) == {"[('cpu', 'torch.float32', 16)]", "k32"}


def test_forward_key_with_tuning():
    base = dict(shapes=static_shape(Bucket(1, 16)), graph={"config": {}, "tp": 2, "code": "c"}, target=T, torch_version=V,
                page_tokens=16, pages_per_seq=16, compiler={"max_autotune": True})
    untuned = forward_spec(**base)
    assert forward_spec(**base, tuning=None).key == untuned.key
    d1 = forward_spec(**base, tuning={"digest": "d1", "objects": []})
    assert d1.key != untuned.key
    assert forward_spec(**base, tuning={"digest": "d1", "objects": [{"key": "x", "sha256": "y"}]}).key == d1.key
    assert forward_spec(**base, tuning={"digest": "d2", "objects": []}).key != d1.key
    assert forward_spec(**base, tuning={"digest": None, "missing": 3}).key not in (d1.key, untuned.key)
    assert d1.to_dict()["tuning"]["digest"] == "d1"


def test_one_tuning_run_per_distinct_target():
    def probe(name, target):
        return HostProbe(name=name, ranks=(0,), memory={}, num_cpus=1, unified=True, target=target, specs=(),
                         local_keys=(), store_keys=(), cache={})

    probes = [probe("h2", "a"), probe("h1", "a"), probe("h3", "b")]
    assert tuning_hosts(probes) == {"a": "h1", "b": "h3"}


def test_summarize_runs():
    run = {"target": T, "mode": "cached", "status": "ok", "measured": 12, "hits": 0, "misses": 6, "measure_s": 30.0}
    hit = {**run, "target": "t2", "measured": 0, "hits": 6, "misses": 0, "measure_s": 0.0}
    s = summarize([run, hit])
    assert (s["status"], s["measured"], s["hits"], s["misses"], s["measure_s"]) == ("ok", 12, 6, 6, 30.0)
    assert [r["target"] for r in s["runs"]] == [T, "t2"] and "reason" not in s
    skipped = summarize([{**run, "status": "skipped", "measured": 0, "reason": "tuning is off"}])
    assert skipped["status"] == "skipped" and skipped["reason"] == "tuning is off"
    assert summarize([])["status"] == "skipped"


def test_bucket_shapes_match_the_exported_graph():
    """Guard: every linear in the real forward is one of `bucket_shapes` (torch.export only, no compile)."""
    torch = pytest.importorskip("torch")
    from torch.export import Dim

    from kiln.host.model import ShardedDecoder, example_inputs

    tp, bucket = 2, Bucket(2, 8)
    model = ShardedDecoder(TINY, tp).eval()
    args = example_inputs(TINY, tp, bucket.batch, bucket.tokens, page_tokens=16, pages_per_seq=4, num_pages=6)
    with torch.no_grad():
        program = torch.export.export(model, args, dynamic_shapes=({}, {}, {2: Dim("p", min=2, max=1 << 20)}, {}))
    seen = set()
    graphs = [m.graph for m in program.graph_module.modules() if isinstance(m, torch.fx.GraphModule)]
    assert len(graphs) > 1  # the layers' linears live in the scan's body graph
    for node in (n for g in graphs for n in g.nodes):
        if node.op == "call_function" and ("linear" in str(node.target) or "mm" in str(node.target)):
            x, w = node.args[0].meta["val"], node.args[1].meta["val"]
            rows = 1
            for d in x.shape[:-1]:
                rows *= int(d)
            seen.add(GemmShape(rows, int(x.shape[-1]), int(w.shape[0]), str(x.dtype).removeprefix("torch.")))
    assert seen and seen == set(bucket_shapes(TINY, tp, bucket))
