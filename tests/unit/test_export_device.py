"""A CUDA export end to end on paper: the graph names its device, the manifest states it, and a consumer
on the wrong device or target is refused by name before anything is fetched (no package compiled here)."""

from __future__ import annotations

import pytest

from kiln.core.model.config import TINY
from kiln.core.machine.target import Target, cpu_target_of, cuda_target_of
from kiln.core.errors import BadInput, IntegrityError
from kiln.core.plan.job import ExportJob
from kiln.core.trust.manifest import build_manifest, check_manifest, forwards_for_host, manifest_device
from kiln.core.plan.recipe import Recipe, parse_buckets
from kiln.core.forwards.shape_ranges import parse_shape_range

H200 = "cuda-sm_90-cu13.0-triton3.6.0-x86-64-v3"
A100 = "cuda-sm_80-cu13.0-triton3.6.0-x86-64-v3"
CPU = "cpu-x86_64-avx2-0123abcd"


def _job() -> ExportJob:
    return ExportJob(export_id="e", model_name="m", checkpoint="/none", config=TINY.to_dict(), tp=2,
                     recipe=Recipe(buckets=parse_buckets("1x8,2x4")), store_url="file:///tmp/s")


def _specs(device: str, target: str):
    return _job().specs(target=target, torch_version="2.13.0", code="c", compiler={}, device=device)


def test_a_cuda_graph_names_its_device_and_a_cpu_graph_is_keyed_as_before():
    cpu, cuda = _specs("cpu", CPU), _specs("cuda", H200)
    assert all("device" not in s.graph for s in cpu)
    assert all(s.graph["device"] == "cuda" for s in cuda)
    # The same target string with and without the device: the device alone splits the keys.
    assert {s.key for s in _specs("cuda", CPU)}.isdisjoint(s.key for s in cpu)
    with pytest.raises(ValueError, match="not 'tpu'"):
        _specs("tpu", CPU)


def _forward(shapes: str, target: str, key: str) -> dict:
    return {"key": key, **parse_shape_range(shapes).to_dict(), "target": target, "object": f"forwards/{key}.pt2",
            "sha256": "a" * 64, "python_free": True, "interface": {"process_group": "0"}}


def _manifest(forwards: list[dict]) -> dict:
    return build_manifest(export_id="e", model={}, recipe={}, tp=2, buckets=[], forwards=forwards, weights={},
                          kv_plan={}, hosts=[], phases=[], signing={"signed": False, "key_fingerprint": None})


def test_the_manifest_states_its_device_and_refuses_a_mix():
    assert manifest_device(_manifest([_forward("1x8", H200, "a" * 16)])) == "cuda"
    cpu = _manifest([_forward("1x8", CPU, "b" * 16)])
    assert cpu["runtime"]["device"] == "cpu" and check_manifest(cpu) is cpu
    with pytest.raises(ValueError, match="one device, not on cpu and cuda"):
        _manifest([_forward("1x8", H200, "a" * 16), _forward("2x4", CPU, "b" * 16)])
    # Edited after the fact (a signed manifest cannot be, but the structure check does not rely on that).
    lying = _manifest([_forward("1x8", CPU, "b" * 16)])
    lying["runtime"]["device"] = "cuda"
    with pytest.raises(IntegrityError, match="says its forwards run on cuda but lists forwards of target"):
        check_manifest(lying)
    lying["runtime"]["device"] = "tpu"
    with pytest.raises(IntegrityError, match="'tpu', not 'cpu' or 'cuda'"):
        check_manifest(lying)
    old = _manifest([_forward("1x8", CPU, "b" * 16)])
    del old["runtime"]["device"]
    assert manifest_device(old) == "cpu"  # written before CUDA exports


def _cuda_host(capability: tuple[int, int]) -> Target:
    return cuda_target_of(machine="x86_64", cpu=CPU, torch_version="2.13.0", capability=capability,
                          cuda_version="13.0", triton_version="3.6.0", has_cpp_march=True)


def _cpu_host(fingerprint: str) -> Target:
    return cpu_target_of(machine=fingerprint.split("-")[1], cpu=fingerprint, torch_version="2.13.0")


def test_a_cuda_export_on_a_host_without_a_gpu_is_refused_by_name():
    m = _manifest([_forward("1x8", H200, "a" * 16)])
    assert _cuda_host((9, 0)).fingerprint == H200 and _cuda_host((8, 0)).fingerprint == A100
    with pytest.raises(BadInput, match=f"compiled for CUDA \\(targets {H200}\\) and this host has no usable GPU"):
        forwards_for_host(m, None, 0)
    with pytest.raises(BadInput, match=f"no forward of shapes 1x8 for this host's target {A100}: forward a+ is for "
                                       f"{H200}: a CUDA forward loads only on a host of its own target"):
        forwards_for_host(m, _cuda_host((8, 0)), 1)
    assert [f["key"] for f in forwards_for_host(m, _cuda_host((9, 0)), 8)] == ["a" * 16]


def test_shapes_with_a_forward_per_target_give_this_hosts():
    other_cpu = "cpu-x86_64-avx512-89abcdef"
    m = _manifest([_forward("1x8", CPU, "a" * 16), _forward("1x8", other_cpu, "b" * 16),
                   _forward("2x4", CPU, "c" * 16), _forward("2x4", other_cpu, "d" * 16)])
    assert [f["key"] for f in forwards_for_host(m, _cpu_host(other_cpu), 0)] == ["b" * 16, "d" * 16]
    assert [f["key"] for f in forwards_for_host(m, _cpu_host(CPU), 0)] == ["a" * 16, "c" * 16]
    with pytest.raises(BadInput, match="no forward of shapes 1x8 for this host's target cpu-aarch64"):
        forwards_for_host(m, _cpu_host("cpu-aarch64-sve256-00000000"), 0)
    # Which CPU runs another's package: tests/unit/test_target_refusal.py.
