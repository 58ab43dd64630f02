"""Recipe validation, worker sizing and KV planning (pure)."""

import pytest

from kiln.core.model.config import TINY, ModelConfig
from kiln.core.errors import BadInput
from kiln.core.model.hf_config import from_hf, to_hf
from kiln.core.plan.recipe import Bucket, Recipe, parse_buckets, recipe_from_text
from kiln.core.plan.sizing import floor_admitting_one, floor_with_margin, page_bytes, plan_kv, required_mib, worker_capacity


def test_incident_one_worker_needs_12288():
    r = Recipe(headroom_floor_mib=8192, recipe_headroom_mib=1024, worker_host_mib=2048, worker_device_mib=2048)
    assert required_mib(r, 1, unified=True, cuda=True) == 12288
    assert worker_capacity(r, available_mib=12038, unified=True, num_cpus=20, cuda=True) == 0
    assert worker_capacity(r, available_mib=12288, unified=True, num_cpus=20, cuda=True) == 1
    r6 = Recipe(headroom_floor_mib=6144, recipe_headroom_mib=1024, worker_host_mib=2048, worker_device_mib=2048)
    assert required_mib(r6, 1, unified=True, cuda=True) == 10240
    assert floor_admitting_one(r, available_mib=12038, unified=True, cuda=True) == 7942
    # With room to spare: 12038 - 4096 x 1.15 = 7327, rounded down to 256 MiB.
    assert floor_with_margin(r, available_mib=12038, unified=True, cuda=True) == 7168


def test_discrete_gpu_takes_worker_device_from_device_memory():
    r = Recipe(worker_device_mib=2048)
    assert required_mib(r, 1, unified=False, cuda=True) == 2048 + 1024
    assert worker_capacity(r, available_mib=100_000, unified=False, num_cpus=64, cuda=True, device_free_mib=4096) == 2


def test_recipe_headroom_wins_when_larger_than_floor():
    r = Recipe(headroom_floor_mib=512, recipe_headroom_mib=4096)
    assert required_mib(r, 2, unified=True, cuda=False) == 4096 + 2 * 1024
    assert floor_admitting_one(r, available_mib=4500, unified=True, cuda=False) is None
    assert floor_with_margin(r, available_mib=4500, unified=True, cuda=False) is None
    # Where the margin would go below the preparation headroom, the exact floor.
    assert floor_with_margin(r, available_mib=5200, unified=True, cuda=False) == floor_admitting_one(
        r, available_mib=5200, unified=True, cuda=False) == 4176


def test_defaults_fit_this_kind_of_machine():
    # A CPU compile worker peaks near 0.8 GiB: the default must admit >= 1 worker on 8 GiB.
    assert worker_capacity(Recipe(), available_mib=8192, unified=True, num_cpus=2, cuda=False) == 2


@pytest.mark.parametrize("spec", ["", "1x", "x16", "0x16", "1x-4", "1*16", "a,b", "1x16,,2x4"])
def test_malformed_buckets(spec):
    with pytest.raises(BadInput, match="bucket|buckets"):
        parse_buckets(spec)


def test_buckets_sorted_and_deduplicated():
    assert parse_buckets("4x64, 1x16,1X16") == (Bucket(1, 16), Bucket(4, 64))


@pytest.mark.parametrize("item", ["worker_host_mib=0", "worker_host_mib=-5", "headroom_floor_mib=-1",
                                  "page_tokens=0", "worker_device_mib=-1", "policy=lend",
                                  "tuning=sometimes", "nonsense=1", "worker_host_mib=lots",
                                  "max_context_tokens=100", "buckets=", "unified_memory=maybe"])
def test_bad_overrides(item):
    with pytest.raises(BadInput):
        recipe_from_text([item])


def test_overrides_are_typed():
    r = recipe_from_text(["headroom_floor_mib=8192", "unified_memory=true", "buckets=2x8",
                          "verify_atol=0.01", "policy=fail"])
    assert r.headroom_floor_mib == 8192 and r.unified_memory is True
    assert r.buckets == (Bucket(2, 8),) and r.verify_atol == 0.01 and r.policy == "fail"
    assert Recipe.from_dict(r.to_dict()) == r


def test_page_bytes_from_config():
    assert page_bytes(num_layers=2, kv_heads_per_rank=6, head_dim=16, page_tokens=16, dtype_bytes=4) \
        == 2 * 2 * 6 * 16 * 16 * 4


def test_kv_plan_takes_minimum_over_ranks():
    r = Recipe(activation_reserve_mib=100)
    size = 1 << 20
    plan = plan_kv(r, page_size_bytes=size, weight_bytes_per_rank=50 << 20,
                   hosts=[([0], 1000, 300), ([1, 2], 1000, 0)])
    # host 0: 1000 - 300 - 100 - 50 = 550 pages; host 1: (1000 - 200 - 100) / 2 = 350 each.
    assert plan.per_rank_pages == {0: 550, 1: 350, 2: 350}
    assert plan.pages_per_rank == 350 and plan.limiting_rank == 1


def test_kv_plan_capped_and_never_negative():
    r = Recipe(kv_max_pages=10)
    plan = plan_kv(r, page_size_bytes=1024, weight_bytes_per_rank=0, hosts=[([0], 10_000, 0), ([1], 1, 500)])
    assert plan.per_rank_pages == {0: 10, 1: 0}


def test_tp_needs_a_whole_unit_for_every_rank():
    TINY.check_tp(6)
    TINY.check_tp(5)  # uneven: kiln.core.model.shares
    small = ModelConfig(vocab_size=8, hidden_size=16, num_layers=1, num_heads=4, num_kv_heads=2, head_dim=4,
                        intermediate_size=8)
    small.check_tp(4)  # more ranks than KV heads: each holds the one its query head uses
    with pytest.raises(BadInput, match=r"it has 4 attention heads, fewer than 5 ranks; use a tp of 1, 2, 3, 4\."):
        small.check_tp(5)


def test_config_round_trip():
    assert from_hf(to_hf(TINY)) == TINY
    with pytest.raises(BadInput, match="neither model_type nor architectures"):
        from_hf({"vocab_size": 3})
    with pytest.raises(BadInput, match="lacks"):
        from_hf({"model_type": "llama", "vocab_size": 3})
