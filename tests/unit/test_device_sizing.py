"""Compile workers' device memory: counted only for CUDA exports, from the device on a discrete GPU and from
the host's pool on unified memory (kiln.core.plan.sizing, gate, decisions). Pure: no GPU, no torch."""

from __future__ import annotations

import pytest

from kiln.core.model.config import TINY
from kiln.core.model.rank_bytes import weight_bytes_per_rank
from kiln.core.plan.decisions import check_devices, decide_export, kv_plan
from kiln.core.errors import BadInput, GateRefused
from kiln.core.forwards.forward_keys import ForwardSpec
from kiln.core.plan.gate import HostReport, decide
from kiln.core.plan.job import ExportJob
from kiln.core.plan.probe_result import HostProbe
from kiln.core.plan.recipe import Bucket, Recipe
from kiln.core.forwards.shape_ranges import parse_shape_range
from kiln.core.plan.sizing import device_required_mib, required_mib, worker_capacity

R = Recipe(headroom_floor_mib=4096, recipe_headroom_mib=1024, worker_host_mib=3000, worker_device_mib=2000)


def test_discrete_gpu_host_memory_for_host_figure_device_memory_for_device_figure():
    assert required_mib(R, 3, unified=False, cuda=True) == 4096 + 3 * 3000
    assert device_required_mib(R, 3, unified=False, cuda=True) == 3 * 2000
    # Host memory admits 10, the device's free memory 4: four workers.
    assert worker_capacity(R, available_mib=4096 + 10 * 3000, unified=False, num_cpus=64, cuda=True,
                           device_free_mib=4 * 2000 + 1999) == 4
    # Plenty of device memory: the host limits.
    assert worker_capacity(R, available_mib=4096 + 2 * 3000, unified=False, num_cpus=64, cuda=True,
                           device_free_mib=143771) == 2


def test_unified_memory_takes_both_from_one_pool():
    assert required_mib(R, 3, unified=True, cuda=True) == 4096 + 3 * (3000 + 2000)
    assert device_required_mib(R, 3, unified=True, cuda=True) == 0
    assert worker_capacity(R, available_mib=4096 + 3 * 5000, unified=True, num_cpus=64, cuda=True) == 3
    assert worker_capacity(R, available_mib=4096 + 3 * 5000 - 1, unified=True, num_cpus=64, cuda=True) == 2


@pytest.mark.parametrize("unified", [True, False])
def test_a_cpu_export_reserves_no_device_memory(unified):
    assert required_mib(R, 3, unified=unified, cuda=False) == 4096 + 3 * 3000
    assert device_required_mib(R, 3, unified=unified, cuda=False) == 0
    # On a GPU host whose device is full, CPU workers are limited by host memory only.
    assert worker_capacity(R, available_mib=4096 + 5 * 3000, unified=unified, num_cpus=64, cuda=False,
                           device_free_mib=0) == 5


def test_gate_names_device_memory_when_that_is_short():
    recipe = R.replace(policy="fail")
    gpu = HostReport("gpu", (0,), available_mib=100_000, num_cpus=8, target="cuda-t", unified=False,
                     device_free_mib=1500, device="cuda")
    with pytest.raises(GateRefused) as err:
        decide([gpu], recipe, {"cuda-t": ["k"]}, set())
    msg = str(err.value)
    assert "1500 MiB of device memory free on its GPU" in msg and "needs 2000 MiB of device memory" in msg
    assert "gpu is 500 MiB of device memory short" in msg and "free 500 MiB of device memory on gpu's GPU" in msg
    assert "MiB available" not in msg  # host memory is not what is short
    # The same host exporting for its CPU compiles.
    cpu = HostReport("gpu", (0,), available_mib=100_000, num_cpus=8, target="cpu-t", unified=False,
                     device_free_mib=1500, device="cpu")
    assert decide([cpu], recipe, {"cpu-t": ["k"]}, set()).hosts["gpu"].capacity == 8


def test_gate_on_unified_memory_counts_the_device_in_the_host_figure():
    recipe = R.replace(policy="fail")
    spark = HostReport("spark", (0,), available_mib=4096 + 4000, num_cpus=8, target="cuda-t", unified=True,
                       device="cuda")
    with pytest.raises(GateRefused) as err:
        decide([spark], recipe, {"cuda-t": ["k"]}, set())
    assert "spark is 1000 MiB short of one compile worker" in str(err.value)
    assert "needs 9096 MiB (headroom 4096 MiB + a worker counted at 3000 MiB, as set in the recipe, + 2000 MiB " \
           "device memory)" in str(err.value)


def probe(name, *, device="cpu", num_gpus=0, unified=True, device_free_mib=None, ranks=(0,)):
    return HostProbe(name=name, ranks=tuple(ranks), num_cpus=8, target=f"{device}-t", unified=unified,
                     memory={"host_available_mib": 60_000, "device_free_mib": device_free_mib},
                     specs=(ForwardSpec(key="k", shapes=parse_shape_range("1x16"), target=f"{device}-t", graph={},
                                        inputs={}, compiler={}),),
                     local_keys=(), store_keys=(), cache={}, num_gpus=num_gpus, device=device)


def job(**recipe):
    return ExportJob(export_id="x", model_name="tiny", checkpoint="/none", config=TINY.to_dict(), tp=2,
                     recipe=Recipe(buckets=(Bucket(1, 16),), **recipe), store_url="file:///none")


def test_cuda_export_refused_by_name_before_the_gate():
    probes = [probe("gpu-0", device="cuda", num_gpus=1, unified=False, device_free_mib=80_000),
              probe("cpu-1", ranks=(1,))]
    with pytest.raises(BadInput, match="device=cuda but cpu-1 has no GPU"):
        decide_export(job(device="cuda"), probes)
    # auto: not every rank host has a GPU, so cpu; a host still probed for cuda must be probed again.
    with pytest.raises(BadInput, match="device is cpu but gpu-0 probed for another device"):
        check_devices(job(device="auto"), probes)
    assert check_devices(job(device="auto"), [probe("gpu-0", num_gpus=1), probe("cpu-1", ranks=(1,))]) == "cpu"
    assert check_devices(job(device="cpu"), [probe("gpu-0", num_gpus=1)]) == "cpu"


def test_kv_plan_of_a_cpu_export_on_a_gpu_host_draws_from_host_memory():
    j = job(worker_host_mib=1000, worker_device_mib=2000, kv_max_pages=10**9)
    on_cpu = HostReport("h", (0, 1), available_mib=60_000, num_cpus=8, target="cpu-t", unified=False,
                        device_free_mib=10_000, device="cpu")
    on_gpu = HostReport("h", (0, 1), available_mib=60_000, num_cpus=8, target="cuda-t", unified=False,
                        device_free_mib=10_000, device="cuda")
    cpu_plan, gpu_plan = kv_plan(j, [on_cpu], {"h": 1}), kv_plan(j, [on_gpu], {"h": 1})
    page, weights = cpu_plan["page_bytes"], weight_bytes_per_rank(TINY, 2)
    left_host = (60_000 - 2048 - 1000 - 2 * 256) * 2**20 - 2 * weights
    left_device = (10_000 - 2000 - 2 * 256) * 2**20 - 2 * weights  # the worker's CUDA context is on the device
    assert cpu_plan["per_rank_pages"]["0"] == left_host // 2 // page
    assert gpu_plan["per_rank_pages"]["0"] == left_device // 2 // page


def test_worker_device_mib_set_for_a_cpu_export_is_named():
    from kiln.core.plan.decisions import settings_without_effect

    recipe = Recipe(worker_device_mib=4096)
    cpu = decide([HostReport("h", (0,), available_mib=60_000, num_cpus=8, target="cpu-x86_64-avx2-0")], recipe,
                 {"cpu-x86_64-avx2-0": ["k"]}, set())
    [warning] = settings_without_effect(recipe, cpu)
    assert warning.startswith("Recipe > 'Device memory per compile worker (MiB)' (4096) did nothing in this run: this is "
                              "a CPU export")
    cuda = decide([HostReport("h", (0,), available_mib=60_000, num_cpus=8, target="cuda-sm_90-x", unified=False,
                              device_free_mib=80_000, device="cuda")], recipe, {"cuda-sm_90-x": ["k"]}, set())
    assert settings_without_effect(recipe, cuda) == []
