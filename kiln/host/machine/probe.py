"""What a host says about itself: memory, CPUs, GPUs and compile target.

Runs on the host it describes. Imports torch lazily so the pure core and the
CLI's input checks stay fast. Never creates a CUDA context in its process: GPUs
are read through NVML or a short-lived child process (gpu_reading).
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import psutil

from kiln.core.machine import cgroup_limits as cg
from kiln.core.machine import gpus
from kiln.core.machine.cpu_target import CpuIsa, cpu_isa
from kiln.core.errors import BadInput
from kiln.core.machine.target import Target, cpu_target_of, cuda_target_of

MIB = 2**20


def _read(root: str, path: str) -> str | None:
    """The text of `path` under the file system `root` (None when it cannot be read)."""
    try:
        return (Path(root) / path.lstrip("/")).read_text()
    except (OSError, UnicodeDecodeError):
        return None


@functools.lru_cache(maxsize=8)
def _dirs(root: str, controller: str) -> tuple[tuple[int, str], ...]:
    """Where this process's cgroups lie does not change while it runs: read once (PeakSampler asks often)."""
    proc_cgroup, mountinfo = _read(root, "/proc/self/cgroup"), _read(root, "/proc/self/mountinfo")
    if proc_cgroup is None or mountinfo is None:  # not Linux
        return ()
    return tuple(cg.cgroup_dirs(controller, proc_cgroup, mountinfo))


def cgroup_memory_limits(root: str = "/") -> list[cg.MemoryLimit]:
    """The memory limits of this process's cgroups and their ancestors (v2 and v1); `root`: for tests."""
    out = []
    for version, d in _dirs(root, "memory"):
        names = ("memory.max", "memory.current") if version == 2 else ("memory.limit_in_bytes",
                                                                       "memory.usage_in_bytes")
        lim = cg.memory_limit(version, d, limit=_read(root, f"{d}/{names[0]}"), usage=_read(root, f"{d}/{names[1]}"),
                              stat=_read(root, f"{d}/memory.stat"))
        if lim is not None:
            out.append(lim)
    return out


def cgroup_cpu_limits(root: str = "/") -> list[cg.CpuLimit]:
    """The CPU quotas of this process's cgroups and their ancestors (v2 and v1); `root`: for tests."""
    out = []
    for version, d in _dirs(root, "cpu"):
        if version == 2:
            lim = cg.cpu_limit(2, d, quota=_read(root, f"{d}/cpu.max"))
        else:
            lim = cg.cpu_limit(1, d, quota=_read(root, f"{d}/cpu.cfs_quota_us"),
                               period=_read(root, f"{d}/cpu.cfs_period_us"))
        if lim is not None:
            out.append(lim)
    return out


def host_memory_bytes(root: str = "/") -> tuple[int, int, str]:
    """(available bytes, total bytes, source) this process can use: the node's (psutil), or its cgroup's
    where that allows less (kiln.core.machine.cgroup_limits); source is 'host' or e.g.
    'cgroup v2 memory.max at /sys/fs/cgroup'. `root`: the file system to read, for tests."""
    vm = psutil.virtual_memory()
    return cg.effective_memory(node_available_bytes=vm.available, node_total_bytes=vm.total,
                               limits=cgroup_memory_limits(root))


def host_memory(root: str = "/") -> dict:
    """host_memory_bytes as MiB: host_available_mib, host_total_mib, and memory_source naming the limit."""
    available, total, source = host_memory_bytes(root)
    return {"host_available_mib": available // MIB, "host_total_mib": total // MIB, "memory_source": source}


def memory_snapshot(reading: gpus.GpuReading | None = None) -> dict:
    """host_memory's figures and the device keys: device_free_mib and device_total_mib (None without a GPU
    or on unified memory), and where a GPU is visible gpu_count, gpu_name and device_unified
    (kiln.core.machine.gpus.GpuReading.memory). Read through NVML or a child process (gpu_reading; or `reading`, one
    just taken): this process never holds a CUDA context. allocated_mib / reserved_mib (this process's CUDA
    allocator) stay None."""
    snap = {**host_memory(), "device_free_mib": None, "device_total_mib": None,
            "allocated_mib": None, "reserved_mib": None}
    snap.update((gpu_reading() if reading is None else reading).memory())
    return snap


def cpus_and_source(root: str = "/") -> tuple[int, str]:
    """CPUs this process may use: its affinity, or its cgroup's CPU quota rounded up where that allows
    fewer; and which ('host', or the cgroup file)."""
    try:
        affinity = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        affinity = os.cpu_count() or 1
    return cg.effective_cpus(affinity_cpus=affinity, limits=cgroup_cpu_limits(root))


def num_cpus() -> int:
    return cpus_and_source()[0]


def unified_memory() -> bool:
    """True on CPU-only hosts; on GPU hosts, true where the first GPU shares the host's memory (GB10, Jetson)."""
    return gpu_reading().unified


CHILD_QUERY = """
import json, torch
rows = []
if torch.cuda.is_available():
    for i in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(i)
        free, total = torch.cuda.mem_get_info(i)
        rows.append({"name": p.name, "capability": [p.major, p.minor], "memory_bytes": [free, total],
                     "integrated": bool(getattr(p, "is_integrated", False))})
print(json.dumps(rows))
"""
"""What the child process asks torch when NVML is not at hand; it exits, and its CUDA context with it."""

CHILD_TIMEOUT_S = 120.0
"""Longest a child process's GPU query may take (importing torch and starting CUDA take seconds)."""


def nvidia_driver_present() -> bool:
    """Whether an NVIDIA driver is loaded here: without one there is no GPU to ask a child process about."""
    return Path("/proc/driver/nvidia/version").exists() or Path("/dev/nvidiactl").exists()


def _nvml():
    """The pynvml module (nvidia-ml-py), or None where it is not installed."""
    try:
        import pynvml
    except ImportError:
        return None
    return pynvml


def nvml_answers(nvml) -> list[gpus.GpuAnswer] | None:
    """One GpuAnswer per GPU CUDA_VISIBLE_DEVICES leaves visible, asked of the `nvml` module (pynvml); None
    when CUDA_VISIBLE_DEVICES names GPUs by UUID (NVML's numbering cannot say which). NVML holds no CUDA
    context. Raises pynvml's NVMLError where NVML cannot answer (no driver)."""
    nvml.nvmlInit()
    try:
        indices = gpus.visible_indices(os.environ.get("CUDA_VISIBLE_DEVICES"), int(nvml.nvmlDeviceGetCount()))
        if indices is None:
            return None
        out = []
        for i in indices:
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            name = nvml.nvmlDeviceGetName(handle)
            major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
            try:
                info = nvml.nvmlDeviceGetMemoryInfo(handle)
                memory = (int(info.free), int(info.total))
            except nvml.NVMLError as exc:
                if getattr(exc, "value", None) != getattr(nvml, "NVML_ERROR_NOT_SUPPORTED", 3):
                    raise
                memory = None  # unified memory (GB10): the device has no memory of its own to report
            out.append(gpus.GpuAnswer(name=name.decode() if isinstance(name, bytes) else str(name),
                                      capability=(int(major), int(minor)), memory_bytes=memory))
        return out
    finally:
        nvml.nvmlShutdown()


def child_answers() -> list[gpus.GpuAnswer]:
    """The visible GPUs as torch sees them, asked in a short-lived child process (CHILD_QUERY)."""
    done = subprocess.run([sys.executable, "-c", CHILD_QUERY], capture_output=True, text=True,
                          timeout=CHILD_TIMEOUT_S, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"exit {done.returncode}: {done.stderr.strip()[-500:]}")
    return gpus.answers_from_child(json.loads(done.stdout.strip().splitlines()[-1]))


def gpu_reading() -> gpus.GpuReading:
    """This host's visible GPUs, without a CUDA context in this process: NVML where nvidia-ml-py is
    installed, else (where an NVIDIA driver is loaded) a child process running torch.cuda queries, else none.
    A reading that fails says why in `.error` and counts no GPU."""
    error = None
    nvml = _nvml()
    if nvml is not None:
        try:
            answers = nvml_answers(nvml)
            if answers is not None:
                return gpus.interpret(answers, "nvml")
        except Exception as exc:  # pynvml.NVMLError and kin: fall back to asking torch
            error = f"NVML: {exc}"
    if not nvidia_driver_present():
        return gpus.GpuReading((), "none", error)
    try:
        return gpus.interpret(child_answers(), "torch child process")
    except (OSError, ValueError, KeyError, IndexError, RuntimeError, subprocess.TimeoutExpired) as exc:
        return gpus.GpuReading((), "none", "; ".join(filter(None, [error, f"torch child process: {exc}"])))


def cpu_description() -> CpuIsa:
    """This host's CPU (kiln.core.machine.cpu_target): architecture, torch's ISA level and instruction-set flags.
    Inductor compiles CPU code with -march=native, so two CPUs share artifacts only when their ISA level and
    instruction-set flags agree (kernel bug, mitigation and virtualisation flags do not count); its
    `fingerprint` is the CPU target."""
    import torch

    try:
        with open("/proc/cpuinfo") as f:
            cpuinfo = f.read()
    except OSError:
        cpuinfo = ""
    return cpu_isa(platform.machine(), torch.backends.cpu.get_cpu_capability(), cpuinfo)


def cpu_fingerprint() -> str:
    """This host's CPU target: cpu_description().fingerprint."""
    return cpu_description().fingerprint


def has_cpp_march() -> bool:
    """Whether this torch's Inductor has `cpp.march` (the C++ wrapper's -march can be pinned)."""
    from torch._inductor import config

    return hasattr(config.cpp, "march")


def _installed_version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def usable_gpus(reading: gpus.GpuReading) -> int:
    """GPUs this host can compile for: those `reading` found, where this torch is a CUDA build (0 otherwise)."""
    if not reading.count:
        return 0
    import torch

    return reading.count if torch.version.cuda else 0


def detect_target(device: str, reading: gpus.GpuReading | None = None) -> Target:
    """This host's compile target for `device` ('cpu' or 'cuda'; kiln.core.machine.target). For cuda: the first
    visible GPU's arch (from `reading`, default gpu_reading()), torch's CUDA and Triton's version, and the
    wrapper's pinned -march where torch has cpp.march. Creates no CUDA context. BadInput for cuda on a
    host without a visible GPU or with a CPU build of torch."""
    import torch

    machine, cpu = platform.machine(), cpu_description()
    if device == "cpu":
        return cpu_target_of(machine=machine, cpu=cpu.fingerprint, torch_version=torch.__version__, cpu_isa=cpu)
    if device != "cuda":
        raise BadInput(f"a host compiles for device 'cpu' or 'cuda', not {device!r}.")
    reading = gpu_reading() if reading is None else reading
    if not reading.count:
        why = f" ({reading.error})" if reading.error else ""
        raise BadInput(f"device=cuda but this host has no visible GPU{why}; export for the CPU with --set "
                       "device=cpu, or run this rank on a GPU host.")
    if not torch.version.cuda:
        raise BadInput(f"device=cuda but this host's torch {torch.__version__} is a CPU build; install a CUDA "
                       "build of torch, or export for the CPU with --set device=cpu.")
    return cuda_target_of(machine=machine, cpu=cpu.fingerprint, torch_version=torch.__version__,
                          capability=reading.gpus[0].capability, cuda_version=torch.version.cuda,
                          triton_version=_installed_version("triton"), has_cpp_march=has_cpp_march(), cpu_isa=cpu)


def consumer_target(device: str) -> tuple[Target | None, int]:
    """(this host's target for `device`, its usable GPUs): what a consumer of an export asks before fetching
    its forwards (kiln.core.trust.manifest.forwards_for_host). No CUDA context is made; a host that cannot
    run `device` answers None."""
    if device == "cpu":
        return detect_target("cpu"), 0
    reading = gpu_reading()
    num_gpus = usable_gpus(reading)
    return (detect_target(device, reading) if num_gpus else None), num_gpus


def target_fingerprint(device: str = "cpu") -> str:
    """detect_target(device).fingerprint: what compiled code for `device` depends on besides torch's version."""
    return detect_target(device).fingerprint
