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
"""

from __future__ import annotations

import hashlib

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


def isa_flags(cpuinfo: str) -> list[str]:
    """The instruction-set flags of the first CPU in `cpuinfo` (the text of /proc/cpuinfo), sorted."""
    for line in cpuinfo.splitlines():
        name, sep, value = line.partition(":")
        if sep and name.strip() in ("flags", "Features"):
            return sorted({f for f in value.split() if f in ISA_FLAGS or f.startswith(ISA_PREFIXES)})
    return []


def cpu_target(machine: str, isa_level: str, cpuinfo: str) -> str:
    """'cpu-<machine>-<isa level>-<hash of the ISA flags>', e.g. 'cpu-x86_64-avx512-1a2b3c4d'."""
    flags = " ".join(isa_flags(cpuinfo))
    return f"cpu-{machine}-{isa_level.lower()}-{hashlib.sha256(flags.encode()).hexdigest()[:TARGET_HASH_CHARS]}"
