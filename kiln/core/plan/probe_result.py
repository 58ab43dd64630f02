"""What a host's probe found, as one frozen record: the gate's, KV planner's and tuner's only input from a host.

Pure. `kiln.host.phases.host_probe.probe_host` builds it on the host; it travels to the
flow (Prefect task result, Dask) and into `kiln.core.plan.decisions`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.core.forwards.forward_keys import ForwardSpec
from kiln.core.machine.cpu_target import CpuIsa


@dataclass(frozen=True)
class HostProbe:
    """One host, probed. Memory is MiB."""

    name: str
    ranks: tuple[int, ...]
    """The tensor-parallel ranks this host runs."""
    memory: dict
    """The memory reading (kiln.host.machine.probe.memory_snapshot): host_available_mib, memory_source (the limit
    that set it: 'host', or a cgroup file), device_free_mib, and with a GPU gpu_count, device_unified, ..."""
    num_cpus: int
    """CPUs this process may use (kiln.host.machine.probe.cpus_and_source): affinity, or a tighter cgroup quota."""
    unified: bool
    """Whether device memory is the host's pool (probed, or the recipe's unified_memory)."""
    target: str
    """The compile target fingerprint (kiln.core.machine.target.Target.fingerprint): hosts of one target share forwards."""
    specs: tuple[ForwardSpec, ...]
    """The forwards this host needs, one per bucket or range of shapes."""
    local_keys: tuple[str, ...]
    """Keys of `specs` already in this host's cache."""
    store_keys: tuple[str, ...]
    """Keys of `specs` already in the store."""
    cache: dict
    """The host cache's status (kiln.host.machine.cache.cache_status): path, error, free_mib."""
    worker_peaks_mib: tuple[int, ...] = ()
    """Compile worker peaks measured before for this graph and target (from the store)."""
    compile_seconds: tuple[tuple[str, float], ...] = ()
    """(forward shapes, compile seconds) of compiles measured before for this graph and target (from the store):
    the gate's time estimate (kiln.core.plan.decisions.compile_estimates)."""
    cpus_source: str = "host"
    """What set num_cpus: 'host' (the process's affinity), or the cgroup file whose quota allows fewer."""
    num_gpus: int = 0
    """GPUs this host can compile for (kiln.host.machine.probe.usable_gpus: visible through NVML or torch, with a
    CUDA build of torch); the recipe's device auto and cuda look at it."""
    device: str = "cpu"
    """'cpu' or 'cuda': the device `target` and `specs` are for (kiln.core.machine.target)."""
    cpu_isa: CpuIsa | None = None
    """This host's CPU (architecture, ISA level, instruction-set flags; kiln.core.machine.target.Target.cpu_isa):
    the manifest's `target_cpu` of the CPU forwards of `target`."""
    tidied: str | None = None
    """What earlier runs had left on the host and the probe removed, in one line (kiln.host.phases.host_tidy)."""

    @property
    def host_available_mib(self) -> int:
        return self.memory["host_available_mib"]

    @property
    def memory_source(self) -> str:
        return self.memory.get("memory_source", "host")

    @property
    def device_free_mib(self) -> int | None:
        return self.memory.get("device_free_mib")
