"""Memory the gate can trust: measured worker peaks, a KV plan that reserves only the workers that run,
and a refusal when the KV cache could not hold the largest bucket. Pure: no server, no torch."""

from dataclasses import replace

import pytest

from kiln.core.model.config import TINY
from kiln.core.model.rank_bytes import weight_bytes_per_rank
from kiln.core.plan.decisions import (RANGE_COMPILE_FACTOR, compile_estimates, describe, host_reports,
                                 measured_worker_mib, plan_kv_for, planned_workers, run_gate)
from kiln.core.errors import GateRefused
from kiln.core.forwards.forward_keys import ForwardSpec
from kiln.core.plan.gate import HostReport, decide
from kiln.core.plan.job import ExportJob
from kiln.core.plan.probe_result import HostProbe
from kiln.core.plan.recipe import Bucket, Recipe, recipe_from_text
from kiln.core.forwards.shape_ranges import parse_shape_range


def test_the_per_worker_figure_says_where_it_comes_from():
    r = Recipe()
    assert r.worker_host_source(None) == (1024, "estimate")
    assert r.worker_host_source(500) == (500, "measured")
    assert Recipe(worker_host_mib=2048).worker_host_source(500) == (2048, "recipe"), "a set figure always wins"
    assert recipe_from_text(["worker_host_mib=auto"]).worker_host_mib is None
    assert measured_worker_mib(Recipe(worker_mib_margin=1.15), [400, 430, 412]) == 495  # ceil(430 x 1.15)
    assert measured_worker_mib(Recipe(), []) is None


def test_gate_uses_the_measured_peak_when_known():
    recipe = Recipe(headroom_floor_mib=2048, recipe_headroom_mib=1024)
    hosts = [HostReport("a", (0,), available_mib=3000, num_cpus=8, target="t", measured_worker_mib=450),
             HostReport("b", (1,), available_mib=3000, num_cpus=8, target="t")]
    plan = decide(hosts, recipe, {"t": ["k1", "k2", "k3"]}, set())
    a, b = plan.hosts["a"], plan.hosts["b"]
    assert (a.worker_mib, a.worker_mib_source, a.capacity) == (450, "measured", 2)  # (3000 - 2048) // 450
    assert (b.worker_mib, b.worker_mib_source, b.capacity) == (1024, "estimate", 0)
    text = describe(plan, hosts)
    assert "450 (measured)" in text and "1024 (estimate)" in text


def spec(key: str, shapes: str, target: str = "t") -> ForwardSpec:
    return ForwardSpec(key=key, shapes=parse_shape_range(shapes), target=target, graph={}, inputs={}, compiler={})


def probe(name, ranks, available, keys, peaks=(), shapes=None, seconds=()):
    return HostProbe(name=name, ranks=tuple(ranks), num_cpus=8, target="t", unified=True,
                     memory={"host_available_mib": available, "device_free_mib": None},
                     specs=tuple(spec(k, (shapes or {}).get(k, "1x16")) for k in keys), local_keys=(),
                     store_keys=(), cache={}, worker_peaks_mib=tuple(peaks), compile_seconds=tuple(seconds))


def job(**recipe):
    return ExportJob(export_id="x", model_name="tiny", checkpoint="/none", config=TINY.to_dict(), tp=2,
                     recipe=Recipe(**recipe), store_url="file:///none")


def test_kv_plan_reserves_only_the_workers_the_gate_starts():
    # Memory for 8 workers, but one forward to compile: one worker runs, and the KV plan reserves one.
    j = job(buckets=(Bucket(1, 16),), headroom_floor_mib=1000, recipe_headroom_mib=1000, worker_host_mib=1000)
    kv = plan_kv_for(j, [probe("h", (0, 1), 9000 + 2 * 256, ["k1"])])
    assert kv["pool_workers"] == {"h": 1}
    page = kv["page_bytes"]
    weights = weight_bytes_per_rank(TINY, 2)
    left = (9000 + 512 - 2000 - 2 * 256) * 2**20 - 2 * weights  # floor + one worker reserved, not eight
    assert kv["per_rank_pages"] == {"0": min(left // 2 // page, 4096), "1": min(left // 2 // page, 4096)}


def test_a_warm_export_plans_the_same_pages_as_a_cold_one():
    # Same hosts and inputs; cold: nothing compiled yet; warm: every forward in the store and host "a"'s
    # cache, so the gate starts no worker. The KV plan keeps the floor and the cold export's workers anyway.
    j = job(buckets=(Bucket(1, 16), Bucket(2, 16)), headroom_floor_mib=1000, recipe_headroom_mib=500,
            worker_host_mib=700, kv_max_pages=10**9)
    keys = ["k1", "k2"]
    cold = [probe("a", (0,), 6000, keys), probe("b", (1,), 6000, keys)]
    warm = [replace(p, store_keys=tuple(keys), local_keys=tuple(keys) if p.name == "a" else ()) for p in cold]
    assert planned_workers(j, warm) == {"a": 0, "b": 0}
    assert plan_kv_for(j, warm) == plan_kv_for(j, cold)
    kv = plan_kv_for(j, warm)
    assert kv["pool_workers"] == {"a": 1, "b": 1}  # two forwards over two hosts: one worker each when cold
    left = (6000 - 1000 - 700 - 256) * 2**20 - weight_bytes_per_rank(TINY, 2)
    assert kv["per_rank_pages"] == {"0": left // kv["page_bytes"], "1": left // kv["page_bytes"]}


def test_the_floor_is_kept_on_a_host_that_compiles_nothing():
    j = job(buckets=(Bucket(1, 16),), headroom_floor_mib=3000, recipe_headroom_mib=500, worker_host_mib=100_000,
            kv_max_pages=10**9)
    kv = plan_kv_for(j, [probe("h", (0, 1), 8000, ["k1"])])  # no worker fits: the gate would refuse
    assert kv["pool_workers"] == {"h": 0}
    left = (8000 - 3000 - 2 * 256) * 2**20 - 2 * weight_bytes_per_rank(TINY, 2)
    assert kv["per_rank_pages"]["0"] == left // 2 // kv["page_bytes"]


def test_a_kv_cache_that_cannot_hold_the_largest_bucket_is_refused():
    j = job(buckets=(Bucket(1, 16), Bucket(8, 64)), kv_max_pages=100, max_context_tokens=256, page_tokens=16)
    probes = [probe("h", (0, 1), 20000, ["k1", "k2"])]
    kv = plan_kv_for(j, probes)
    assert kv["pages_per_rank"] == 100
    with pytest.raises(GateRefused) as err:
        run_gate(j, probes, kv)
    msg = str(err.value)
    assert "100 pages per rank (limited by rank 0 on h)" in msg
    assert "bucket 8x64 needs 128 (8 sequences x 16 pages of 16 tokens for a context of 256)" in msg
    assert "max_compile_workers" in msg and "max_context_tokens" in msg
    run_gate(j.replace(recipe=Recipe(buckets=(Bucket(1, 16), Bucket(6, 64)), kv_max_pages=100)), probes,
             plan_kv_for(j.replace(recipe=Recipe(buckets=(Bucket(1, 16), Bucket(6, 64)), kv_max_pages=100)), probes))


def test_reports_carry_the_measured_figure():
    j = job()
    [r] = host_reports(j, [probe("h", (0,), 5000, ["k"], peaks=[400, 420])])
    assert r.measured_worker_mib == 483


def test_checks_that_would_not_fit_are_refused_before_they_start():
    from kiln.core.errors import MemoryShort
    from kiln.core.plan.sizing import check_peak_mib, verify_peak_mib
    from kiln.host.phases.rank_check import check_memory

    j = job()
    shard = weight_bytes_per_rank(TINY, 2)
    need = check_memory(j, 4, 100_000, "host h")
    assert need == check_peak_mib(shard_bytes=shard, num_forwards=4, half=False, process_base_mib=512)
    with pytest.raises(MemoryShort, match=f"host h: checking one rank against eager needs about {need} MiB"):
        check_memory(j, 4, need - 1, "host h")
    # bfloat16 also runs eager in float32: more per byte of shard.
    assert check_peak_mib(shard_bytes=2**30, num_forwards=1, half=True, process_base_mib=0) == 4 * 1024 + 16
    assert check_peak_mib(shard_bytes=2**30, num_forwards=1, half=False, process_base_mib=0) == 3 * 1024 + 16
    assert verify_peak_mib(shard_bytes=2**30, full_bytes=2**31, tp=2, num_forwards=1, half=False,
                           process_base_mib=100) == 2 * (100 + 16 + 1024) + 3 * 2048


def test_every_forward_of_a_rank_binds_one_copy_of_its_weights_so_more_buckets_cost_only_their_code():
    # Llama-3.1-70B at tp 8 in bfloat16 (a ~17 GiB shard): 38 buckets, the incident's count, cost 38 x 16 MiB
    # more than one, not 37 more shards.
    from kiln.core.plan.sizing import FORWARD_FIXED_MIB, check_peak_mib, verify_peak_mib

    shard = 17 * 2**30
    one, many = (check_peak_mib(shard_bytes=shard, num_forwards=n, half=True, process_base_mib=512) for n in (1, 38))
    assert many - one == 37 * FORWARD_FIXED_MIB
    assert many < 512 + 5 * 17 * 1024  # weights, two eager shards (16-bit and float32: 3 copies), transient, code
    one, many = (verify_peak_mib(shard_bytes=shard, full_bytes=8 * shard, tp=8, num_forwards=n, half=True,
                                 process_base_mib=512) for n in (1, 38))
    assert many - one == 8 * 37 * FORWARD_FIXED_MIB


def test_a_rank_check_that_would_not_fit_is_refused_before_anything_compiles():
    # Qwen3-30B-A3B's width, 2 layers, bfloat16: a host with room for compile workers but not for the check.
    from kiln.core.plan.sizing import check_peak_mib

    cfg = TINY.replace(architecture="qwen3_moe", qk_norm=True, num_layers=2, hidden_size=2048, num_heads=32,
                       num_kv_heads=4, head_dim=128, intermediate_size=6144, vocab_size=151936, num_experts=128,
                       experts_per_token=8, moe_intermediate_size=768, moe_layers=(0, 1), dtype="bfloat16")
    j = ExportJob(export_id="x", model_name="wide", checkpoint="/none", config=cfg.to_dict(), tp=2,
                  recipe=Recipe(buckets=(Bucket(1, 16), Bucket(1, 1))), store_url="file:///none")
    need = check_peak_mib(shard_bytes=weight_bytes_per_rank(cfg, 2), num_forwards=2, half=True, process_base_mib=512)
    shapes = {"k1": "1x16", "k2": "1x1"}  # a rank checks one forward per shapes
    run_gate(j, [probe("h", (0, 1), need, ["k1", "k2"], shapes=shapes)])
    with pytest.raises(GateRefused, match=f"host h needs about {need} MiB to check one rank against eager "
                                          r"\(2 forward\(s\) of a \d+ MiB shard in bfloat16\) but "
                                          f"{need - 1} MiB are available.*Nothing was compiled"):
        run_gate(j, [probe("h", (0, 1), need - 1, ["k1", "k2"], shapes=shapes)])


def test_the_gate_expects_a_range_to_take_longer_and_then_what_was_measured():
    shapes = {"s1": "1x1", "s2": "1x16", "r": "2-64x1@64x1"}
    j = job(buckets=(Bucket(1, 1),), compile_s_estimate=30.0, headroom_floor_mib=1000, recipe_headroom_mib=500,
            worker_host_mib=1000)
    fresh = [probe("h", (0, 1), 2600, sorted(shapes), shapes=shapes)]  # memory for one worker: times add up
    assert compile_estimates(j, fresh) == {"s1": 30.0, "s2": 30.0, "r": 30.0 * RANGE_COMPILE_FACTOR}
    assert run_gate(j, fresh).predicted_s == pytest.approx(60 + 30 * RANGE_COMPILE_FACTOR)

    # Compiles of this graph measured before (any shapes of a kind count for that kind): their median.
    measured = [replace(fresh[0], compile_seconds=(("1x4", 10.0), ("1x1", 14.0), ("4x1", 11.0), ("2-8x1@8x1", 50.0)))]
    assert compile_estimates(j, measured) == {"s1": 11.0, "s2": 11.0, "r": 50.0}
    plan = run_gate(j, measured)
    assert plan.predicted_s == pytest.approx(72.0) and "about 72 s" in plan.message
    # Another target's measurements say nothing about this one's.
    elsewhere = replace(fresh[0], name="g", target="u", specs=(spec("u1", "1x1", target="u"),))
    assert compile_estimates(j, measured + [elsewhere]) == {"s1": 11.0, "s2": 11.0, "r": 50.0, "u1": 30.0}
