"""The gate's arithmetic and assignment on paper layouts (no server, no torch)."""

import pytest

from kiln.core.errors import GateRefused
from kiln.core.plan.gate import HostReport, decide
from kiln.core.plan.recipe import Recipe

INCIDENT = Recipe(headroom_floor_mib=8192, recipe_headroom_mib=1024, worker_host_mib=2048,
                  worker_device_mib=2048, unified_memory=True)
KEYS = [f"k{i:02d}" for i in range(38)]


def host(name, available, ranks=(0,), cpus=8, target="t", **kw):
    return HostReport(name=name, ranks=tuple(ranks), available_mib=available, num_cpus=cpus,
                      target=target, **kw)


def incident_hosts():
    """The incident's GB10 hosts: a CUDA export on unified memory, the CUDA context out of the host's pool."""
    return [host("host-0", 30000, (0,), device="cuda"), host("host-1", 12038, (1,), device="cuda"),
            host("host-2", 11939, (2,), device="cuda")]


def test_incident_fail_policy_names_each_short_host():
    recipe = Recipe(**{**INCIDENT.__dict__, "policy": "fail"})
    with pytest.raises(GateRefused) as err:
        decide(incident_hosts(), recipe, {"t": KEYS}, set(), page_size_bytes=2**20)
    msg = str(err.value)
    # The figure explained: the headroom, then the worker (its source) and its device memory.
    why = "(headroom 8192 MiB + a worker counted at 2048 MiB, as set in the recipe, + 2048 MiB device memory)"
    # Who is short and by how much first, then the figures.
    assert msg.startswith("export refused before compiling: host-1 is 250 MiB short of one compile worker: it has "
                          f"12038 MiB available but one worker needs 12288 MiB {why}; host-2 is 349 MiB short ")
    assert "host-0" not in msg.split("To fix")[0]
    # 11939 - 4096 would admit one worker with nothing to spare; 11939 - 4096 x 1.15 (the margin Kiln keeps),
    # rounded down to 256 MiB, leaves 675 MiB; the fix names the form's field, the CLI's flag and the default.
    assert ("set Recipe > 'Headroom floor (MiB)' to 7168 in the run form (CLI: --set headroom_floor_mib=7168): that "
            "admits one worker on every short host with 675 MiB to spare (Kiln keeps a margin of 1.15 x a worker's "
            "memory); the default is 2048 MiB") in msg
    assert "--set policy=borrow" in msg and "host-0 (5 workers)" in msg
    assert "250 fewer KV pages per rank" in msg


def test_incident_borrow_policy_lends_everything_to_host0():
    plan = decide(incident_hosts(), INCIDENT, {"t": KEYS}, set())
    assert plan.decision == "compile"
    assert sorted(plan.hosts["host-0"].compile) == KEYS
    assert plan.hosts["host-1"].compile == [] and plan.hosts["host-2"].compile == []
    assert plan.hosts["host-1"].download == KEYS and plan.hosts["host-2"].download == KEYS
    assert plan.hosts["host-0"].download == []
    # 30000 MiB: (30000 - 8192) // 4096 = 5 workers; 38 keys of 30 s over 5 slots -> 8 rounds.
    assert plan.hosts["host-0"].workers == 5
    assert plan.predicted_s == pytest.approx(8 * 30.0)


def test_incident_with_6gib_floor_shares_compilation():
    recipe = Recipe(**{**INCIDENT.__dict__, "headroom_floor_mib": 6144})
    plan = decide(incident_hosts(), recipe, {"t": KEYS}, set())
    assert all(plan.hosts[n].capacity >= 1 for n in ("host-0", "host-1", "host-2"))
    assert all(plan.hosts[n].compile for n in ("host-0", "host-1", "host-2"))
    compiled = [k for p in plan.hosts.values() for k in p.compile]
    assert sorted(compiled) == KEYS  # each key exactly once


def test_keys_spread_in_proportion_to_workers():
    hosts = [host("a", 2048 + 4 * 1024, cpus=8), host("b", 2048 + 1024, cpus=8)]
    plan = decide(hosts, Recipe(), {"t": KEYS[:10]}, set())
    assert (plan.hosts["a"].capacity, plan.hosts["b"].capacity) == (4, 1)
    assert len(plan.hosts["a"].compile) == 8 and len(plan.hosts["b"].compile) == 2


def test_workers_capped_by_cpus_and_by_work():
    plan = decide([host("a", 100_000, cpus=2)], Recipe(), {"t": KEYS[:1]}, set())
    assert plan.hosts["a"].capacity == 2 and plan.hosts["a"].workers == 1


def test_store_hits_are_downloaded_not_compiled():
    plan = decide([host("a", 100_000), host("b", 10, ranks=(1,))], Recipe(), {"t": KEYS[:4]},
                  set(KEYS[:4]))
    assert plan.decision == "nothing_to_do"
    assert plan.hosts["b"].download == KEYS[:4]


def test_local_cache_hits_need_no_download():
    a = host("a", 100_000, local_keys=frozenset(KEYS[:2]))
    plan = decide([a], Recipe(), {"t": KEYS[:4]}, set(KEYS[:4]))
    assert plan.hosts["a"].download == KEYS[2:4]


def test_several_ranks_per_host_count_once():
    hosts = [host("a", 100_000, ranks=(0, 1, 2, 3)), host("b", 100, ranks=(4, 5, 6, 7))]
    plan = decide(hosts, Recipe(), {"t": KEYS[:6]}, set())
    assert sorted(plan.hosts["a"].compile) == KEYS[:6]
    assert plan.hosts["b"].download == KEYS[:6]


def test_mixed_targets_never_lend_across_targets():
    hosts = [host("x86", 100_000, target="avx512"), host("arm", 100, ranks=(1,), target="neon")]
    needed = {"avx512": ["a1", "a2"], "neon": ["n1", "n2"]}
    with pytest.raises(GateRefused) as err:
        decide(hosts, Recipe(), needed, set())
    assert "arm is 2972 MiB short of one compile worker: it has 100 MiB available" in str(err.value)
    assert "add a host of the same target" in str(err.value)


def test_mixed_targets_each_compile_their_own():
    hosts = [host("x86", 100_000, target="avx512"), host("arm", 100_000, ranks=(1,), target="neon")]
    plan = decide(hosts, Recipe(), {"avx512": ["a1"], "neon": ["n1"]}, set())
    assert plan.hosts["x86"].compile == ["a1"] and plan.hosts["arm"].compile == ["n1"]


def test_zero_capacity_everywhere_refuses_under_borrow():
    with pytest.raises(GateRefused) as err:
        decide([host("a", 1000), host("b", 2000, ranks=(1,))], Recipe(), {"t": KEYS[:2]}, set())
    msg = str(err.value)
    assert "a is 2072 MiB short of one compile worker: it has 1000 MiB" in msg and "b is 1072 MiB short" in msg
    assert "policy=borrow" not in msg


def test_zero_capacity_is_fine_when_nothing_is_missing():
    plan = decide([host("a", 10)], Recipe(policy="fail"), {"t": KEYS[:2]}, set(KEYS[:2]))
    assert plan.decision == "nothing_to_do"


def test_rankless_host_lends_compilers():
    hosts = [host("big", 100_000, ranks=()), host("small", 100, ranks=(0,))]
    plan = decide(hosts, Recipe(), {"t": KEYS[:3]}, set())
    assert sorted(plan.hosts["big"].compile) == KEYS[:3] and plan.hosts["big"].download == []


def test_uneven_measured_seconds_balance_finish_times():
    hosts = [host("a", 2048 + 1024, cpus=1), host("b", 2048 + 1024, cpus=1, ranks=(1,))]
    secs = {"long": 100.0, "s1": 30.0, "s2": 30.0, "s3": 30.0}
    plan = decide(hosts, Recipe(), {"t": list(secs)}, set(), compile_s=secs)
    owner = "a" if "long" in plan.hosts["a"].compile else "b"
    other = "b" if owner == "a" else "a"
    assert plan.hosts[owner].compile == ["long"]
    assert sorted(plan.hosts[other].compile) == ["s1", "s2", "s3"]
    assert plan.predicted_s == pytest.approx(100.0)


def test_discrete_gpu_short_on_device_memory():
    recipe = Recipe(worker_device_mib=2048, policy="fail")
    gpu = host("gpu", 100_000, unified=False, device_free_mib=1000, device="cuda")
    with pytest.raises(GateRefused) as err:
        decide([gpu], recipe, {"t": ["k"]}, set())
    msg = str(err.value)
    assert ("gpu is 1048 MiB of device memory short of one compile worker: it has 1000 MiB of device memory free "
            "on its GPU but one compile worker of a CUDA export needs 2048 MiB of device memory there") in msg
    assert "free 1048 MiB of device memory on gpu's GPU" in msg
    assert err.value.short_hosts["gpu"]["device_short_mib"] == 1048


def test_duplicate_host_names_refused():
    with pytest.raises(GateRefused):
        decide([host("a", 1), host("a", 1)], Recipe(), {"t": []}, set())


def test_equal_finish_times_spread_over_hosts():
    hosts = [host("a", 2048 + 2 * 1024, cpus=2), host("b", 2048 + 1024, ranks=(1,)), host("c", 2048 + 1024, ranks=(2,))]
    plan = decide(hosts, Recipe(), {"t": KEYS[:3]}, set())
    assert [len(plan.hosts[n].compile) for n in "abc"] == [1, 1, 1]
    assert plan.hosts["a"].workers == 1


def test_scale_on_paper_assigns_every_key_once():
    hosts = [host(f"h{i:02d}", 64_000, ranks=tuple(range(8 * i, 8 * i + 8)), cpus=8) for i in range(64)]
    keys = [f"b{i:02d}" for i in range(67)]
    plan = decide(hosts, Recipe(), {"t": keys}, set())
    assert sorted(k for p in plan.hosts.values() for k in p.compile) == keys


def test_replan_without_lost_hosts_gives_their_keys_to_the_rest():
    from kiln.core.plan.decisions import replan_without
    from kiln.core.plan.job import ExportJob

    job = ExportJob(export_id="e", model_name="m", checkpoint="/x", config={}, tp=2, recipe=Recipe(),
                    store_url="file:///s")
    hosts = [host("a", 100_000, cpus=2), host("b", 100_000, ranks=(1,), cpus=2), host("c", 100, ranks=(2,))]
    out = replan_without(job, hosts, {"b"}, ["k1", "k2"], {"k1": "t", "k2": "t"})
    assert set(out) == {"a"} and sorted(out["a"][0]) == ["k1", "k2"] and out["a"][1] == 2
    with pytest.raises(GateRefused):  # nobody left with a worker
        replan_without(job, hosts, {"a", "b"}, ["k1"], {"k1": "t"})


def test_the_replan_rule_gives_up_after_max_replans():
    from kiln.core.plan.decisions import MAX_REPLANS, replan_after_loss
    from kiln.core.errors import HostsLost
    from kiln.core.plan.job import ExportJob

    job = ExportJob(export_id="e", model_name="m", checkpoint="/x", config={}, tp=2, recipe=Recipe(),
                    store_url="file:///s")
    hosts = [host("a", 100_000, cpus=2), host("b", 100_000, ranks=(1,), cpus=2)]
    for done in range(MAX_REPLANS):
        assert set(replan_after_loss(job, hosts, {"b"}, ["k1"], {"k1": "t"}, replans_done=done)) == {"a"}
    with pytest.raises(HostsLost, match="1 forward\\(s\\) are still missing. Re-run to resume"):
        replan_after_loss(job, hosts, {"b"}, ["k1"], {"k1": "t"}, replans_done=MAX_REPLANS)


def test_a_setting_that_cannot_matter_is_named():
    from kiln.core.plan.decisions import settings_without_effect

    hosts = [host("a", 100_000, local_keys=frozenset(KEYS))]
    recipe = Recipe(worker_host_mib=65536, page_tokens=8, max_context_tokens=64)
    nothing = decide(hosts, recipe, {"t": KEYS}, set(KEYS))
    assert nothing.decision == "nothing_to_do"
    [warning] = settings_without_effect(Recipe(worker_host_mib=65536, policy="fail", page_tokens=8,
                                               max_context_tokens=64), nothing)
    # In the form's words, with why; page_tokens still matters (the KV plan).
    assert warning == ("nothing to compile (every forward was already in the store), so the gate's and the "
                       "compiler's settings were not needed; these did nothing in this run: Recipe > 'When a host "
                       "cannot compile' (fail), Recipe > 'Memory per compile worker (MiB)' (65536)")
    busy = decide([host("a", 100_000)], recipe, {"t": KEYS}, set())
    assert busy.decision == "compile" and settings_without_effect(recipe, busy) == []
    assert settings_without_effect(Recipe(), nothing) == []
