"""The CPU compile target: what of a CPU changes the code Inductor generates for it.

Inductor compiles CPU kernels with `-march=native`, so a package runs only on
CPUs with the instruction sets it was compiled for. Two CPUs share a target
when their architecture, torch's ISA level (DEFAULT, AVX2, AVX512, ...) and
their instruction-set flags agree.

Only instruction-set flags count: `/proc/cpuinfo` also lists what the kernel
or hypervisor makes of the CPU (the separate `bugs` line, mitigations such as
`pti`, `ibpb`, `md_clear`, `retpoline`, virtualisation flags such as
`hypervisor`, `vmx`, `ept`, timer and topology flags), which change with the
kernel, its boot options and the hypervisor, and never with the generated
code. Keeping them out lets identical CPUs on different kernels share
forwards. A flag counts when it is in `ISA_FLAGS` or starts with one of
`ISA_PREFIXES` (so a new AVX/AMX/SVE extension splits targets without an edit
here). Pure: no torch import; kiln.host.machine.probe reads the text and the ISA level.

Which CPU runs which CPU's code (`cannot_run`): a package compiled on CPU P
runs on CPU H when both have one architecture, P's ISA level is H's or a
lower one, and every instruction-set flag of P is one of H's. Code for a
baseline runs on a newer CPU; AVX-512 code on an AVX2 CPU, or x86_64 code on
aarch64, does not (it dies with SIGILL at its first such instruction). The
fingerprint hashes the flags, so the manifest records each CPU forward's
`CpuIsa` beside it (`target_cpu`) for a consumer to decide by.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

ISA_FLAGS = frozenset("""
    mmx pni ssse3 popcnt abm lahf_lm lm cx8 cx16 cmov fxsr fpu xsave xsaveopt xsavec xsaves aes pclmulqdq
    f16c fma fma4 xop tbm lwp bmi1 bmi2 adx rdrand rdseed movbe 3dnowprefetch prefetchwt1 fsgsbase rdpid
    clflushopt clwb clzero mwaitx wbnoinvd pku rtm hle gfni vaes vpclmulqdq movdiri movdir64b serialize
    tsxldtrk waitpkg cldemote enqcmd ptwrite hreset cmpccxadd prefetchi
    fp asimd pmull sha1 sha2 crc32 atomics fphp asimdhp asimdrdm jscvt fcma lrcpc dcpop sha3 sm3 sm4
    asimddp sha512 asimdfhm dit uscat ilrcpc flagm sb paca pacg dcpodp flagm2 frint i8mm bf16 rng bti mte
""".split())
"""Instruction-set flags (x86 `flags`, aarch64 `Features`) that `-march=native` compiles for."""

ISA_PREFIXES = ("sse", "avx", "amx", "sha", "sve", "sme", "asimd")
"""Flag families that are instruction sets, whatever their next member is called."""

TARGET_HASH_CHARS = 8

ISA_LEVEL_RANK = {"no avx": 0, "default": 0, "avx2": 1, "avx512": 2, "sve256": 1, "vsx": 1, "z vector": 1}
"""torch's CPU capability levels (torch.backends.cpu.get_cpu_capability, lowercased), lowest 0; levels of
one architecture compare by rank. A level not listed here matches only itself."""


@dataclass(frozen=True)
class CpuIsa:
    """A CPU as the code compiled for it sees it; `fingerprint` is its CPU target."""

    arch: str
    """platform.machine(): 'x86_64', 'aarch64'."""
    level: str
    """torch's ISA level, lowercased: 'default', 'avx2', 'avx512', 'sve256'."""
    flags: tuple[str, ...]
    """Its instruction-set flags (`isa_flags`), sorted."""

    @property
    def fingerprint(self) -> str:
        """'cpu-<arch>-<level>-<hash of the flags>', e.g. 'cpu-x86_64-avx512-1a2b3c4d'."""
        flags = " ".join(self.flags)
        return f"cpu-{self.arch}-{self.level}-{hashlib.sha256(flags.encode()).hexdigest()[:TARGET_HASH_CHARS]}"

    def to_dict(self) -> dict:
        """The manifest's `target_cpu` of a forward: {'arch', 'isa_level', 'isa_flags'}."""
        return {"arch": self.arch, "isa_level": self.level, "isa_flags": list(self.flags)}

    @classmethod
    def from_dict(cls, d: object) -> "CpuIsa":
        """The CpuIsa of a manifest's `target_cpu`; ValueError unless it is {'arch': str, 'isa_level': str,
        'isa_flags': [str, ...] sorted, without repeats}."""
        if not (isinstance(d, dict) and isinstance(d.get("arch"), str) and isinstance(d.get("isa_level"), str)
                and isinstance(d.get("isa_flags"), list) and all(isinstance(f, str) for f in d["isa_flags"])
                and d["isa_flags"] == sorted(set(d["isa_flags"]))):
            raise ValueError(f"{d!r} is not a CPU description ({{'arch', 'isa_level', 'isa_flags': sorted}})")
        return cls(arch=d["arch"], level=d["isa_level"], flags=tuple(d["isa_flags"]))


def cpu_isa(machine: str, isa_level: str, cpuinfo: str) -> CpuIsa:
    """The CpuIsa of a CPU of architecture `machine`, torch ISA level `isa_level` and /proc/cpuinfo `cpuinfo`."""
    return CpuIsa(arch=machine, level=isa_level.lower(), flags=tuple(isa_flags(cpuinfo)))


def arch_and_level(fingerprint: str) -> tuple[str, str] | None:
    """(arch, level) named in a CPU target fingerprint 'cpu-<arch>-<level>-<hash>'; None if it is not one."""
    head, sep, digest = fingerprint.rpartition("-")
    arch, _, level = head.removeprefix("cpu-").partition("-")
    if not (head.startswith("cpu-") and sep and arch and level and len(digest) == TARGET_HASH_CHARS):
        return None
    return arch, level


def level_above(package: str, host: str) -> bool:
    """Whether ISA level `package` asks more than level `host` has (an unlisted level: unless the same)."""
    if package in ISA_LEVEL_RANK and host in ISA_LEVEL_RANK:
        return ISA_LEVEL_RANK[package] > ISA_LEVEL_RANK[host]
    return package != host


def cannot_run(package: CpuIsa, host: CpuIsa) -> str | None:
    """Why CPU `host` cannot run code compiled for CPU `package` (one clause), or None when it can: one
    architecture, the package's ISA level at most the host's, its instruction-set flags among the host's."""
    if package.arch != host.arch:
        return f"it is {package.arch} code and this CPU is {host.arch}"
    if level_above(package.level, host.level):
        return f"it needs ISA level {package.level} and this CPU's is {host.level}"
    missing = sorted(set(package.flags) - set(host.flags))
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        return f"it needs instruction sets this CPU lacks ({shown})"
    return None


def isa_flags(cpuinfo: str) -> list[str]:
    """The instruction-set flags of the first CPU in `cpuinfo` (the text of /proc/cpuinfo), sorted."""
    for line in cpuinfo.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() in ("flags", "Features"):
            return sorted({f for f in value.split() if f in ISA_FLAGS or f.startswith(ISA_PREFIXES)})
    return []


def cpu_target(machine: str, isa_level: str, cpuinfo: str) -> str:
    """'cpu-<machine>-<isa level>-<hash of the ISA flags>', e.g. 'cpu-x86_64-avx512-1a2b3c4d'."""
    return cpu_isa(machine, isa_level, cpuinfo).fingerprint
