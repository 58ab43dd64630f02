"""A compile target: the device a forward runs on and what of the host its compiled code depends on.

One place defines a target and its fingerprint. Hosts of one fingerprint share
forwards (the fingerprint is hashed into every forward key beside the torch
version, kiln.core.forwards.forward_keys), so everything that changes the generated code
and is not hashed elsewhere is in it:

- `cpu`: the host CPU's ISA (kiln.core.machine.cpu_target). Inductor compiles CPU
  kernels with `-march=native`, so a CPU package runs only on CPUs with the
  instruction sets it was compiled for. Unchanged from before targets had a
  device: 'cpu-x86_64-avx512-1a2b3c4d'.
- `cuda`: the GPU arch (sm_90), the CUDA runtime torch was built with, the
  Triton version (it generates the kernels), and the CPU code the package's
  C++ wrapper is built for. The wrapper is host code; Inductor builds it with
  `-march=native` unless `cpp.march` is set (torch/_inductor/cpp_builder.py,
  `_get_cpu_arch_cflags`). Where the torch on the host has `cpp.march`, a CUDA
  forward's wrapper is built for a pinned baseline (CUDA_WRAPPER_MARCH:
  x86-64-v3, armv8.2-a) so GPU hosts with different CPUs share packages; the
  wrapper only launches kernels, so the baseline costs no GPU time. Where torch
  has no `cpp.march` (2.13 has it; it came with pytorch#184297, May 2026, so
  older releases may not: kiln.host.machine.probe.has_cpp_march asks), the wrapper is
  native and the fingerprint carries the host's CPU target instead:
  'cuda-sm_90-cu13.0-triton3.6.0-x86-64-v3' or
  'cuda-sm_90-cu12.8-triton3.3.1-cpu-x86_64-avx512-1a2b3c4d'.
  The pinned -march covers the wrapper. A CPU kernel inside a CUDA graph (an
  op on a CPU tensor) would also be vectorised for the host's ISA (Inductor's
  `pick_vec_isa`, AVX512 or AMX), which no -march pins: a CUDA forward must
  keep every tensor on the device for the fingerprint to hold (to be confirmed
  on a GPU: no CPU kernel in a CUDA package).

The torch version is part of a target but not of its fingerprint: every key
that hashes the fingerprint (forwards, tuning results) hashes torch's version
beside it, and leaving it out keeps a CPU fingerprint what it always was.

The recipe's `device` picks the device: `cpu` always (a GPU host compiles CPU
forwards too: its CPU runs them), `cuda` on hosts that have a GPU (else the
export is refused by name before anything starts), `auto` CUDA where every
rank's host has a GPU, else cpu. Pure: no torch import (kiln.host.machine.probe reads
the host and builds a Target with `cpu_target_of` / `cuda_target_of`).
"""

from __future__ import annotations

import typing
from dataclasses import dataclass
from typing import Literal

from kiln.core.errors import BadInput
from kiln.core.machine.cpu_target import CpuIsa

Device = Literal["auto", "cpu", "cuda"]
"""What the recipe's `device` may say."""
DEVICES: tuple[str, ...] = typing.get_args(Device)

CUDA_WRAPPER_MARCH = {"x86_64": "x86-64-v3", "amd64": "x86-64-v3", "aarch64": "armv8.2-a", "arm64": "armv8.2-a"}
"""`-march` of a CUDA forward's C++ wrapper, per `platform.machine()`, where torch has `cpp.march`.
x86-64-v3 (AVX2, FMA, BMI2; GCC 11+) is in every x86 CPU sold with a data-centre GPU since Haswell/Zen 2;
armv8.2-a is below Grace (Neoverse V2) and GB10 (Cortex-X925)."""


@dataclass(frozen=True)
class Target:
    """What compiled code of one host depends on, besides the graph and Kiln's own options."""

    device: str
    """'cpu' or 'cuda': where the forward runs."""
    machine: str
    """The host CPU's architecture (platform.machine(): 'x86_64', 'aarch64')."""
    cpu: str
    """The host CPU's target (kiln.core.machine.cpu_target.cpu_target): its ISA level and instruction-set flags."""
    torch_version: str
    """torch.__version__ on the host (hashed beside the fingerprint, not in it)."""
    march: str | None = None
    """`-march` the C++ wrapper is built for (Inductor's `cpp.march`); None: native, the host CPU's own."""
    cuda_arch: str | None = None
    """The GPU's arch, e.g. 'sm_90' (compute capability 9.0); None for cpu."""
    cuda_version: str | None = None
    """torch.version.cuda, e.g. '13.0'; None for cpu."""
    triton_version: str | None = None
    """The installed Triton's version; None for cpu (or where Triton is not installed)."""
    cpu_isa: CpuIsa | None = None
    """The host CPU itself (architecture, ISA level, instruction-set flags), of which `cpu` is the fingerprint:
    what a consumer compares with a package's `target_cpu`; None where only the fingerprint is known."""

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"a target's device is 'cpu' or 'cuda', not {self.device!r}")
        if self.device == "cuda" and not self.cuda_arch:
            raise ValueError("a cuda target needs the GPU's arch")
        if self.cpu_isa is not None and self.cpu_isa.fingerprint != self.cpu:
            raise ValueError(f"the CPU described ({self.cpu_isa.fingerprint}) is not the target's CPU {self.cpu}")

    @property
    def fingerprint(self) -> str:
        """Hosts of one fingerprint share forwards (see the module docstring for what it holds)."""
        if self.device == "cpu":
            return self.cpu
        host = self.march or self.cpu  # a pinned -march names its architecture (x86-64-v3, armv8.2-a)
        return f"cuda-{self.cuda_arch}-cu{self.cuda_version}-triton{self.triton_version or 'none'}-{host}"

    @property
    def inductor_options(self) -> dict:
        """Inductor options this target adds to a forward's: the wrapper's `cpp.march` when pinned, else none."""
        return {"cpp.march": self.march} if self.march else {}


def cpu_target_of(*, machine: str, cpu: str, torch_version: str, cpu_isa: CpuIsa | None = None) -> Target:
    """The cpu target of a host whose CPU target is `cpu` (native code: no march pinned); `cpu_isa`, where
    known, describes that CPU."""
    return Target(device="cpu", machine=machine, cpu=cpu, torch_version=torch_version, cpu_isa=cpu_isa)


def cuda_target_of(*, machine: str, cpu: str, torch_version: str, capability: tuple[int, int],
                   cuda_version: str | None, triton_version: str | None, has_cpp_march: bool,
                   cpu_isa: CpuIsa | None = None) -> Target:
    """The cuda target of a host with a GPU of compute `capability` (major, minor); `has_cpp_march`:
    whether the host's torch has Inductor's `cpp.march` (then the wrapper is built for CUDA_WRAPPER_MARCH)."""
    march = CUDA_WRAPPER_MARCH.get(machine) if has_cpp_march else None
    return Target(device="cuda", machine=machine, cpu=cpu, torch_version=torch_version, march=march,
                  cuda_arch=cuda_arch(capability), cuda_version=cuda_version, triton_version=triton_version,
                  cpu_isa=cpu_isa)


def cuda_arch(capability: tuple[int, int]) -> str:
    """'sm_90' for compute capability (9, 0), 'sm_121' for (12, 1)."""
    major, minor = capability
    return f"sm_{major}{minor}"


def device_of(fingerprint: str) -> str:
    """'cuda' or 'cpu': the device of a target fingerprint."""
    return "cuda" if fingerprint.startswith("cuda-") else "cpu"


def host_device(requested: str, num_gpus: int) -> str:
    """The device one host compiles for, seen from that host alone: `auto` is cuda where it has a GPU.
    (`resolve_device` then makes every host agree.)"""
    if requested not in DEVICES:
        raise BadInput(f"device must be one of {', '.join(DEVICES)}, not {requested!r}.")
    if requested == "auto":
        return "cuda" if num_gpus > 0 else "cpu"
    return requested


def resolve_device(requested: str, gpus_by_host: dict[str, int]) -> str:
    """The export's device from the recipe's `device` and each rank host's GPU count.

    cpu: always (a GPU host's CPU runs CPU forwards). cuda: BadInput naming every host without a GPU.
    auto: cuda when every host has a GPU, else cpu (every rank runs the same device's package).
    """
    if requested not in DEVICES:
        raise BadInput(f"device must be one of {', '.join(DEVICES)}, not {requested!r}.")
    without = sorted(name for name, n in gpus_by_host.items() if n <= 0)
    if requested == "cuda" and without:
        raise BadInput(f"device=cuda but {', '.join(without)} {'has' if len(without) == 1 else 'have'} no GPU "
                       "(none visible to this process): a CUDA forward is compiled on a GPU. To fix: run those "
                       "ranks on GPU hosts, or export for the CPU (--set device=cpu; auto picks cuda only where "
                       "every rank's host has a GPU).")
    if requested == "auto":
        return "cuda" if gpus_by_host and not without else "cpu"
    return requested
