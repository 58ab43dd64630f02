"""What a host says about itself: memory, CPUs and compile target.

Runs on the host it describes. Imports torch lazily so the pure core and the
CLI's input checks stay fast.
"""

from __future__ import annotations

import os
import platform

import psutil

MIB = 2**20


def memory_snapshot() -> dict:
    """Host available/total MiB (psutil) and, with CUDA, device free/total and allocator MiB."""
    vm = psutil.virtual_memory()
    snap = {"host_available_mib": vm.available // MIB, "host_total_mib": vm.total // MIB,
            "device_free_mib": None, "device_total_mib": None,
            "allocated_mib": None, "reserved_mib": None}
    import torch
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        snap.update(device_free_mib=free // MIB, device_total_mib=total // MIB,
                    allocated_mib=torch.cuda.memory_allocated() // MIB,
                    reserved_mib=torch.cuda.memory_reserved() // MIB)
    return snap


def num_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


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
