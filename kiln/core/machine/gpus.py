"""A host's GPUs as its probe reads them, without holding a CUDA context: pure interpretation of the answers.

kiln.host.machine.probe asks NVML (nvidia-ml-py's `pynvml`) or, without it, a
short-lived child process running torch.cuda queries, and hands the raw
answers here. Memory is MiB.

Unified or discrete: a GPU that shares the host's memory (GB10 / DGX Spark,
Jetson) has no memory of its own. NVML says so by answering "Not Supported" to
`nvmlDeviceGetMemoryInfo` (or, on some drivers, a total of 0); torch by the
device's `is_integrated`. A name of a known integrated part (INTEGRATED_NAMES)
also counts, for drivers that answer with the host pool's figures. On unified
memory compile workers' device memory comes out of the host's pool
(kiln.core.plan.sizing); the device figures are then None.
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 2**20

INTEGRATED_NAMES = ("GB10", "Jetson", "Orin", "Thor", "Xavier")
"""Parts of GPU names that share the host's memory (matched case-insensitively)."""


@dataclass(frozen=True)
class GpuAnswer:
    """What NVML (or the torch child process) answered about one GPU, raw."""

    name: str
    """The device's name, e.g. 'NVIDIA H200'."""
    capability: tuple[int, int]
    """CUDA compute capability (major, minor): (9, 0) on H100/H200, (12, 1) on GB10."""
    memory_bytes: tuple[int, int] | None
    """(free, total) device memory in bytes; None where the device answered 'Not Supported'."""
    integrated: bool | None = None
    """torch's is_integrated where the answer came from torch; None from NVML (it does not say)."""


@dataclass(frozen=True)
class Gpu:
    """One GPU visible to this host's processes, interpreted."""

    index: int
    """Its index among the visible GPUs (CUDA_VISIBLE_DEVICES applied): cuda:<index>."""
    name: str
    capability: tuple[int, int]
    unified: bool
    """Whether its memory is the host's pool (see the module docstring)."""
    free_mib: int | None
    """Device memory free now; None on unified memory."""
    total_mib: int | None
    """Device memory in all; None on unified memory."""


@dataclass(frozen=True)
class GpuReading:
    """A host's visible GPUs and where the reading came from."""

    gpus: tuple[Gpu, ...]
    source: str
    """'nvml', 'torch child process', or 'none' (no NVIDIA device, or neither could answer)."""
    error: str | None = None
    """Why no reading could be had where there seemed to be a GPU (NVML and the child both failed)."""

    @property
    def count(self) -> int:
        return len(self.gpus)

    @property
    def unified(self) -> bool:
        """True when the first GPU (the one compile workers use) shares the host's memory, or there is none."""
        return not self.gpus or self.gpus[0].unified

    def memory(self) -> dict:
        """The ledger's device keys (only when a GPU is visible): gpu_count, gpu_name, device_unified, and the
        first GPU's device_free_mib / device_total_mib (None on unified memory)."""
        if not self.gpus:
            return {}
        first = self.gpus[0]
        return {"gpu_count": self.count, "gpu_name": first.name, "device_unified": first.unified,
                "device_free_mib": first.free_mib, "device_total_mib": first.total_mib}


def is_integrated_name(name: str) -> bool:
    return any(part.lower() in name.lower() for part in INTEGRATED_NAMES)


def interpret(answers: list[GpuAnswer], source: str) -> GpuReading:
    """The reading of `answers` (one per visible GPU, in cuda:<index> order)."""
    gpus = []
    for i, a in enumerate(answers):
        unified = bool(a.integrated) or is_integrated_name(a.name) or a.memory_bytes is None \
            or a.memory_bytes[1] == 0
        free, total = (None, None) if unified else (a.memory_bytes[0] // MIB, a.memory_bytes[1] // MIB)
        gpus.append(Gpu(index=i, name=a.name, capability=tuple(a.capability), unified=unified,
                        free_mib=free, total_mib=total))
    return GpuReading(tuple(gpus), source if gpus else "none")


def visible_indices(cuda_visible_devices: str | None, count: int) -> list[int] | None:
    """The NVML indices CUDA makes visible, in order, from CUDA_VISIBLE_DEVICES (None: unset, all of them).

    CUDA stops at the first entry it cannot use; `[]` hides every GPU. None when the list names GPUs by UUID
    or MIG instance (NVML numbering cannot say which): ask torch in a child process instead.
    """
    if cuda_visible_devices is None:
        return list(range(count))
    out: list[int] = []
    for part in (p.strip() for p in cuda_visible_devices.split(",")):
        if not part:
            break
        if part.startswith(("GPU-", "MIG-")):
            return None
        if not part.lstrip("-").isdigit():
            break
        index = int(part)
        if index < 0 or index >= count or index in out:
            break
        out.append(index)
    return out


def answers_from_child(rows: list[dict]) -> list[GpuAnswer]:
    """GpuAnswers from the torch child process's JSON rows (kiln.host.machine.probe.CHILD_QUERY): name, capability,
    memory_bytes [free, total], integrated."""
    return [GpuAnswer(name=str(r["name"]), capability=(int(r["capability"][0]), int(r["capability"][1])),
                      memory_bytes=None if r.get("memory_bytes") is None
                      else (int(r["memory_bytes"][0]), int(r["memory_bytes"][1])),
                      integrated=r.get("integrated")) for r in rows]
