"""A target per host and its fingerprint, and the recipe's device across hosts (kiln.core.machine.target). Pure."""

from __future__ import annotations

import pytest

from kiln.core.errors import BadInput
from kiln.core.forwards.forward_keys import forward_spec
from kiln.core.plan.recipe import Bucket, Recipe, recipe_from_text
from kiln.core.forwards.shape_ranges import static_shape
from kiln.core.machine.target import (CUDA_WRAPPER_MARCH, Target, cpu_target_of, cuda_target_of, device_of, host_device,
                              resolve_device)

SPR = "cpu-x86_64-avx512-1a2b3c4d"  # a Sapphire Rapids host's CPU target (kiln.core.machine.cpu_target)
GENOA = "cpu-x86_64-avx512-9f8e7d6c"  # another CPU of the same ISA level, other flags


def h200(cpu: str, *, has_cpp_march: bool = True, triton: str | None = "3.6.0") -> Target:
    return cuda_target_of(machine="x86_64", cpu=cpu, torch_version="2.13.0+cu130", capability=(9, 0),
                          cuda_version="13.0", triton_version=triton, has_cpp_march=has_cpp_march)


def test_cpu_fingerprint_is_the_cpu_target_as_before():
    t = cpu_target_of(machine="x86_64", cpu=SPR, torch_version="2.13.0")
    assert t.fingerprint == SPR and t.march is None and t.inductor_options == {}
    assert device_of(t.fingerprint) == "cpu"


def test_cuda_fingerprint_names_arch_cuda_triton_and_the_pinned_wrapper_march():
    t = h200(SPR)
    assert t.fingerprint == "cuda-sm_90-cu13.0-triton3.6.0-x86-64-v3"
    assert t.cuda_arch == "sm_90" and t.march == "x86-64-v3" and device_of(t.fingerprint) == "cuda"
    assert t.inductor_options == {"cpp.march": "x86-64-v3"}  # what the compile must apply for the key to hold
    gb10 = cuda_target_of(machine="aarch64", cpu="cpu-aarch64-sve-00000000", torch_version="2.13.0",
                          capability=(12, 1), cuda_version="13.0", triton_version="3.6.0", has_cpp_march=True)
    assert gb10.fingerprint == "cuda-sm_121-cu13.0-triton3.6.0-armv8.2-a"
    assert CUDA_WRAPPER_MARCH["aarch64"] == "armv8.2-a"


def test_gpu_hosts_with_different_cpus_share_only_when_the_wrapper_march_is_pinned():
    assert h200(SPR).fingerprint == h200(GENOA).fingerprint
    # A torch without cpp.march builds the wrapper -march=native: the host's CPU target keeps CPUs apart.
    native = h200(SPR, has_cpp_march=False)
    assert native.march is None and native.inductor_options == {}
    assert native.fingerprint == f"cuda-sm_90-cu13.0-triton3.6.0-{SPR}"
    assert native.fingerprint != h200(GENOA, has_cpp_march=False).fingerprint


def test_arch_cuda_and_triton_each_split_targets():
    base = h200(SPR)
    other_arch = cuda_target_of(machine="x86_64", cpu=SPR, torch_version="2.13.0", capability=(8, 0),
                                cuda_version="13.0", triton_version="3.6.0", has_cpp_march=True)
    other_cuda = cuda_target_of(machine="x86_64", cpu=SPR, torch_version="2.13.0", capability=(9, 0),
                                cuda_version="12.8", triton_version="3.6.0", has_cpp_march=True)
    prints = {base.fingerprint, other_arch.fingerprint, other_cuda.fingerprint, h200(SPR, triton="3.5.1").fingerprint}
    assert len(prints) == 4


def test_forward_keys_keep_a_hosts_cpu_and_cuda_targets_apart():
    cpu, cuda = cpu_target_of(machine="x86_64", cpu=SPR, torch_version="2.13.0"), h200(SPR)

    def key(t: Target) -> str:
        return forward_spec(shapes=static_shape(Bucket(1, 16)), graph={"g": 1}, target=t.fingerprint, torch_version="2.13.0",
                            page_tokens=16, pages_per_seq=16, compiler={"x": 1, **t.inductor_options}).key
    assert key(cpu) != key(cuda)


def test_a_target_needs_a_device_and_a_cuda_target_its_arch():
    with pytest.raises(ValueError):
        Target(device="rocm", machine="x86_64", cpu=SPR, torch_version="2.13.0")
    with pytest.raises(ValueError):
        Target(device="cuda", machine="x86_64", cpu=SPR, torch_version="2.13.0")


def test_auto_is_cuda_only_where_every_rank_host_has_a_gpu():
    assert resolve_device("auto", {"a": 1, "b": 8}) == "cuda"
    assert resolve_device("auto", {"a": 1, "b": 0}) == "cpu"
    assert resolve_device("auto", {}) == "cpu"
    assert host_device("auto", 1) == "cuda" and host_device("auto", 0) == "cpu"


def test_cpu_is_allowed_on_gpu_hosts():
    assert resolve_device("cpu", {"a": 8, "b": 8}) == "cpu"
    assert host_device("cpu", 8) == "cpu"


def test_cuda_without_a_gpu_is_refused_naming_every_such_host():
    with pytest.raises(BadInput) as err:
        resolve_device("cuda", {"gpu-0": 1, "cpu-1": 0, "cpu-2": 0})
    msg = str(err.value)
    assert "device=cuda but cpu-1, cpu-2 have no GPU" in msg and "gpu-0" not in msg
    assert "--set device=cpu" in msg and err.value.exit_code == 2
    assert resolve_device("cuda", {"gpu-0": 1}) == "cuda"


def test_device_is_a_recipe_setting_with_choices():
    assert Recipe().device == "auto"
    assert recipe_from_text(["device=cuda"]).device == "cuda"
    with pytest.raises(BadInput):
        recipe_from_text(["device=tpu"])
