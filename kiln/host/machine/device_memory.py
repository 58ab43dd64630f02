"""The device memory of the process that runs this code: its CUDA context and what its allocator held.

Runs only in a process that is meant to hold a CUDA context for its life (a
compile worker, a rank, a check's child), never in a flow's own process: the
first CUDA call creates the context and nothing gives it back.

- the context: device memory in use after this process's first CUDA call minus
  before it, the "before" read through NVML (nvidia-ml-py), which needs no
  context. Without nvidia-ml-py it is unknown (None). Other processes starting
  their own contexts at the same moment are counted in, so it is measured
  before anything else this process does on the device;
- the allocator's peak: torch.cuda.max_memory_reserved (what the caching
  allocator took from the device) and max_memory_allocated (what tensors used),
  since the last `reset_peak`.

A process's device peak is its context plus the allocator's reserved peak.
"""

from __future__ import annotations

import os

MIB = 2**20

_CONTEXT: dict[int, int | None] = {}
"""GPU index -> this process's context bytes (None: unknown), measured at its first CUDA call."""


def nvml_used_bytes(index: int) -> int | None:
    """Device memory in use on CUDA device `index` (all processes'), as NVML counts it, without creating a
    CUDA context; None without nvidia-ml-py or a driver."""
    try:
        import pynvml
    except ImportError:
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if ids and not all(v.isdigit() for v in ids):
        return None  # UUIDs or MIG names: NVML's index of this device is not known here
    nvml_index = int(ids[index]) if ids and index < len(ids) else index
    try:
        pynvml.nvmlInit()
        try:
            return int(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(nvml_index)).used)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # pynvml.NVMLError, a missing libnvidia-ml: the figure is unknown, nothing else is wrong
        return None


def start_cuda(device: str = "cuda") -> int | None:
    """Create this process's CUDA context on `device` ('cuda' is the current GPU, 'cuda:N' makes N current)
    once, and return its size in bytes (None when unknown). Later calls return the first measurement."""
    import torch

    index = torch.device(device).index
    if index is None:  # the current GPU: 0 in a process that has not chosen one
        index = torch.cuda.current_device() if torch.cuda.is_initialized() else 0
    if index in _CONTEXT:
        return _CONTEXT[index]
    before = nvml_used_bytes(index)
    torch.cuda.set_device(index)
    free, total = torch.cuda.mem_get_info(index)  # the first driver call: the context exists after it
    _CONTEXT[index] = None if before is None else max(0, total - free - before)
    return _CONTEXT[index]


def reset_peak(device: str = "cuda") -> None:
    """Start a new peak for `allocator_peak`, from what live tensors hold: blocks the allocator keeps cached
    from earlier work (a previous forward's compile) are given back first, so they do not count again."""
    import gc

    import torch

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)


def allocator_peak(device: str = "cuda") -> dict[str, int]:
    """{'reserved_mib', 'allocated_mib'}: the caching allocator's peaks on `device` since `reset_peak`."""
    import torch

    return {"reserved_mib": -(-torch.cuda.max_memory_reserved(device) // MIB),
            "allocated_mib": -(-torch.cuda.max_memory_allocated(device) // MIB)}


def used_bytes(device: str = "cuda") -> tuple[int, int]:
    """(in use, total) bytes of `device` as the driver reports them (every process's), from this process."""
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return total - free, total
