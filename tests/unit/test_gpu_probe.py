"""The GPU probe from recorded NVML answers (a fake pynvml module): no GPU, no CUDA context needed."""

from __future__ import annotations

import sys
import types

import pytest

from kiln.core.machine import gpus
from kiln.core.errors import BadInput
from kiln.host.machine import probe

MIB = 2**20


class NVMLError(Exception):
    def __init__(self, value):
        super().__init__(f"NVML error {value}")
        self.value = value


def fake_nvml(devices: list[dict], *, init_error: int | None = None) -> types.ModuleType:
    """A pynvml stand-in answering for `devices` (name, cc, memory (free, total) bytes or None: Not Supported)."""
    m = types.ModuleType("pynvml")
    m.NVMLError, m.NVML_ERROR_NOT_SUPPORTED = NVMLError, 3
    m.calls = []

    def init():
        m.calls.append("init")
        if init_error is not None:
            raise NVMLError(init_error)

    def memory(i):
        if devices[i]["memory"] is None:
            raise NVMLError(3)
        free, total = devices[i]["memory"]
        return types.SimpleNamespace(free=free, total=total, used=total - free)

    m.nvmlInit, m.nvmlShutdown = init, lambda: m.calls.append("shutdown")
    m.nvmlDeviceGetCount = lambda: len(devices)
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetName = lambda i: devices[i]["name"]
    m.nvmlDeviceGetCudaComputeCapability = lambda i: devices[i]["cc"]
    m.nvmlDeviceGetMemoryInfo = memory
    return m


H200 = {"name": "NVIDIA H200", "cc": (9, 0), "memory": (140000 * MIB, 143771 * MIB)}
GB10 = {"name": b"NVIDIA GB10", "cc": (12, 1), "memory": None}  # NVML answers Not Supported on GB10


@pytest.fixture
def no_child(monkeypatch):
    """Fail the test if the torch child process would be started."""
    def child():
        raise AssertionError("the child process was started")
    monkeypatch.setattr(probe, "child_answers", child)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def use(monkeypatch, module):
    monkeypatch.setitem(sys.modules, "pynvml", module)


def test_h200_is_a_discrete_gpu_with_its_memory(monkeypatch, no_child):
    nvml = fake_nvml([H200])
    use(monkeypatch, nvml)
    r = probe.gpu_reading()
    assert r.source == "nvml" and r.count == 1 and not r.unified
    g = r.gpus[0]
    assert (g.name, g.capability, g.free_mib, g.total_mib) == ("NVIDIA H200", (9, 0), 140000, 143771)
    assert r.memory() == {"gpu_count": 1, "gpu_name": "NVIDIA H200", "device_unified": False,
                          "device_free_mib": 140000, "device_total_mib": 143771}
    assert nvml.calls == ["init", "shutdown"]


def test_gb10_is_unified_memory(monkeypatch, no_child):
    use(monkeypatch, fake_nvml([GB10]))
    r = probe.gpu_reading()
    assert r.count == 1 and r.unified and r.gpus[0].capability == (12, 1) and r.gpus[0].name == "NVIDIA GB10"
    assert r.memory()["device_free_mib"] is None and r.memory()["device_unified"] is True


def test_integrated_names_and_zero_totals_are_unified_too():
    # Some drivers answer a GB10's memory with the host's figures, or with zeros.
    by_name = gpus.interpret([gpus.GpuAnswer("NVIDIA GB10", (12, 1), (100 * MIB, 120 * MIB))], "nvml")
    zero = gpus.interpret([gpus.GpuAnswer("NVIDIA N1X", (12, 1), (0, 0))], "nvml")
    torch_says = gpus.interpret([gpus.GpuAnswer("Orin", (8, 7), (1, 2), integrated=True)], "torch child process")
    assert by_name.unified and zero.unified and torch_says.unified


def test_cuda_visible_devices_picks_and_orders_gpus(monkeypatch, no_child):
    other = {**H200, "name": "NVIDIA H100", "memory": (1000 * MIB, 81559 * MIB)}
    use(monkeypatch, fake_nvml([H200, other]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,0")
    assert [g.name for g in probe.gpu_reading().gpus] == ["NVIDIA H100", "NVIDIA H200"]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert probe.gpu_reading().count == 0
    assert gpus.visible_indices("0,7,1", 2) == [0]  # CUDA stops at the first index it cannot use
    assert gpus.visible_indices("GPU-8e1f2a", 2) is None  # a UUID: NVML's numbering cannot say which


def test_without_nvml_or_driver_there_is_no_gpu_and_no_child(monkeypatch, no_child):
    monkeypatch.setitem(sys.modules, "pynvml", None)  # not installed: import raises ImportError
    monkeypatch.setattr(probe, "nvidia_driver_present", lambda: False)
    r = probe.gpu_reading()
    assert (r.count, r.source, r.unified, r.memory()) == (0, "none", True, {})


def test_nvml_failing_falls_back_to_a_child_process(monkeypatch):
    use(monkeypatch, fake_nvml([], init_error=9))  # NVML_ERROR_DRIVER_NOT_LOADED
    monkeypatch.setattr(probe, "nvidia_driver_present", lambda: True)
    monkeypatch.setattr(probe, "child_answers", lambda: gpus.answers_from_child(
        [{"name": "NVIDIA H200", "capability": [9, 0], "memory_bytes": [2 * MIB, 4 * MIB], "integrated": False}]))
    r = probe.gpu_reading()
    assert r.source == "torch child process" and r.gpus[0].total_mib == 4

    def broken():
        raise RuntimeError("exit 1: no CUDA")
    monkeypatch.setattr(probe, "child_answers", broken)
    r = probe.gpu_reading()
    assert r.count == 0 and "NVML: NVML error 9" in r.error and "no CUDA" in r.error


def test_memory_snapshot_keeps_host_keys_and_adds_device_keys_only_with_a_gpu(monkeypatch):
    monkeypatch.setattr(probe, "gpu_reading", lambda: gpus.GpuReading((), "none"))
    snap = probe.memory_snapshot()
    assert {"host_available_mib", "host_total_mib", "memory_source", "device_free_mib", "device_total_mib",
            "allocated_mib", "reserved_mib"} == set(snap)
    reading = gpus.interpret([gpus.GpuAnswer("NVIDIA H200", (9, 0), (140000 * MIB, 143771 * MIB))], "nvml")
    monkeypatch.setattr(probe, "gpu_reading", lambda: reading)
    snap = probe.memory_snapshot()
    assert snap["device_free_mib"] == 140000 and snap["gpu_count"] == 1 and snap["device_unified"] is False


def test_the_probe_never_opens_a_cuda_context_in_its_process(monkeypatch, no_child):
    torch = pytest.importorskip("torch")

    def forbidden(*a, **k):
        raise AssertionError("torch.cuda queried in the flow's process")
    for name in ("mem_get_info", "is_available", "get_device_properties", "get_device_capability", "init"):
        monkeypatch.setattr(torch.cuda, name, forbidden)
    use(monkeypatch, fake_nvml([H200]))
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(probe, "_installed_version", lambda dist: "3.6.0")
    assert probe.memory_snapshot()["device_total_mib"] == 143771
    assert probe.unified_memory() is False
    target = probe.detect_target("cuda")
    assert target.cuda_arch == "sm_90" and target.fingerprint.startswith("cuda-sm_90-cu13.0-triton3.6.0-")
    assert probe.usable_gpus(probe.gpu_reading()) == 1


def test_cuda_target_refused_without_a_gpu_or_a_cuda_torch(monkeypatch):
    torch = pytest.importorskip("torch")
    with pytest.raises(BadInput, match="no visible GPU"):
        probe.detect_target("cuda", gpus.GpuReading((), "none"))
    monkeypatch.setattr(torch.version, "cuda", None)
    h200 = gpus.interpret([gpus.GpuAnswer("NVIDIA H200", (9, 0), (1, 2))], "nvml")
    with pytest.raises(BadInput, match="CPU build"):
        probe.detect_target("cuda", h200)
    assert probe.usable_gpus(h200) == 0
    assert probe.detect_target("cpu", h200).fingerprint == probe.target_fingerprint("cpu")


def test_the_ledger_records_device_figures_only_where_there_is_a_gpu():
    from kiln.core.run.report import Report

    report = Report("e", model="m", tp=1, store="file:///s")
    host = {"host_available_mib": 9000, "device_free_mib": None, "allocated_mib": None, "reserved_mib": None}
    report.memory("cpu-host", "probe", host)
    reading = gpus.interpret([gpus.GpuAnswer("NVIDIA H200", (9, 0), (140000 * MIB, 143771 * MIB))], "nvml")
    report.memory("gpu-host", "probe", {**host, **reading.memory()})
    assert set(report.hosts["cpu-host"]["memory"][0]) == {"phase", "host_available_mib", "device_free_mib",
                                                          "allocated_mib", "reserved_mib"}
    entry = report.hosts["gpu-host"]["memory"][0]
    assert (entry["device_free_mib"], entry["device_total_mib"], entry["gpu_count"], entry["device_unified"]) == \
        (140000, 143771, 1, False)
