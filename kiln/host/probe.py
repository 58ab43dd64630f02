"""What a host says about itself: memory, CPUs and compile target.

Runs on the host it describes. Imports torch lazily so the pure core and the
CLI's input checks stay fast.
"""

from __future__ import annotations

import functools
import os
import platform
from pathlib import Path

import psutil

from kiln.core import cgroup_limits as cg

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
    where that allows less (kiln.core.cgroup_limits); source is 'host' or e.g.
    'cgroup v2 memory.max at /sys/fs/cgroup'. `root`: the file system to read, for tests."""
    vm = psutil.virtual_memory()
    return cg.effective_memory(node_available_bytes=vm.available, node_total_bytes=vm.total,
                               limits=cgroup_memory_limits(root))


def host_memory(root: str = "/") -> dict:
    """host_memory_bytes as MiB: host_available_mib, host_total_mib, and memory_source naming the limit."""
    available, total, source = host_memory_bytes(root)
    return {"host_available_mib": available // MIB, "host_total_mib": total // MIB, "memory_source": source}


def memory_snapshot() -> dict:
    """host_memory's figures and, with CUDA, device free/total and allocator MiB."""
    snap = {**host_memory(), "device_free_mib": None, "device_total_mib": None,
            "allocated_mib": None, "reserved_mib": None}
    import torch
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        snap.update(device_free_mib=free // MIB, device_total_mib=total // MIB,
                    allocated_mib=torch.cuda.memory_allocated() // MIB,
                    reserved_mib=torch.cuda.memory_reserved() // MIB)
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
    """True on CPU-only hosts; on CUDA hosts, true for integrated GPUs (GB10, Jetson)."""
    import torch
    if not torch.cuda.is_available():
        return True
    return bool(getattr(torch.cuda.get_device_properties(0), "is_integrated", False))


def target_fingerprint() -> str:
    """What compiled code depends on besides torch: GPU arch + CUDA, or CPU ISA and flags.

    Inductor compiles CPU code with -march=native, so two CPUs share artifacts
    only when their ISA level and instruction-set flags agree (kiln.core.cpu_target;
    kernel bug, mitigation and virtualisation flags do not count).
    """
    import torch

    from kiln.core.cpu_target import cpu_target
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability(0)
        return f"cuda-sm{major}{minor}-cuda{torch.version.cuda}"
    try:
        with open("/proc/cpuinfo") as f:
            cpuinfo = f.read()
    except OSError:
        cpuinfo = ""
    return cpu_target(platform.machine(), torch.backends.cpu.get_cpu_capability(), cpuinfo)
