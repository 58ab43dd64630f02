"""The CPU target hashes the instruction sets, not what the kernel says about the CPU (kiln.core.machine.cpu_target)."""

from __future__ import annotations

from kiln.core.machine.cpu_target import cpu_target, isa_flags

ISA = ("fpu mmx sse sse2 pni ssse3 sse4_1 sse4_2 popcnt aes pclmulqdq avx avx2 fma f16c bmi1 bmi2 adx "
       "movbe xsave xsaveopt xsavec avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni sha_ni")


def _cpuinfo(flags: str, bugs: str, model: str = "Intel(R) Xeon(R) Platinum 8480+") -> str:
    block = (f"processor\t: {{n}}\nvendor_id\t: GenuineIntel\nmodel name\t: {model}\nmicrocode\t: 0x2b000461\n"
             f"flags\t\t: {flags}\nvmx flags\t: vnmi preemption_timer posted_intr invvpid ept_x_only\n"
             f"bugs\t\t: {bugs}\nbogomips\t: 4000.00\n\n")
    return "".join(block.replace("{n}", str(n)) for n in range(2))


# One CPU under two kernels: the older one with PTI and retpolines, the newer one with IBRS and a hypervisor
# that exposes other virtualisation flags; microcode and bug lists differ too.
OLD_KERNEL = _cpuinfo(f"{ISA} pti ibpb retpoline md_clear flush_l1d ssbd constant_tsc rep_good nopl",
                      "spectre_v1 spectre_v2 spec_store_bypass swapgs mds")
NEW_KERNEL = _cpuinfo(f"{ISA} hypervisor ibrs_enhanced ibpb stibp arch_capabilities user_shstk tsc_known_freq "
                      "vmx ept vpid split_lock_detect", "spectre_v1 spectre_v2 spec_store_bypass gds bhi")


def test_bug_mitigation_and_virtualisation_flags_do_not_change_the_target():
    assert isa_flags(OLD_KERNEL) == isa_flags(NEW_KERNEL)
    assert cpu_target("x86_64", "AVX512", OLD_KERNEL) == cpu_target("x86_64", "AVX512", NEW_KERNEL)
    assert not {"pti", "ibpb", "md_clear", "hypervisor", "vmx", "ept", "user_shstk"} & set(isa_flags(NEW_KERNEL))


def test_an_instruction_set_flag_changes_the_target():
    without = _cpuinfo(ISA.replace(" avx512f", ""), "spectre_v1")
    assert "avx512f" in isa_flags(OLD_KERNEL) and "avx512f" not in isa_flags(without)
    assert cpu_target("x86_64", "AVX512", OLD_KERNEL) != cpu_target("x86_64", "AVX512", without)
    # A future extension of a known family counts without an edit to the list.
    newer = _cpuinfo(f"{ISA} avx10_2", "spectre_v1")
    assert cpu_target("x86_64", "AVX512", newer) != cpu_target("x86_64", "AVX512", OLD_KERNEL)


def test_the_isa_level_and_machine_are_part_of_the_target():
    t = cpu_target("x86_64", "AVX512", OLD_KERNEL)
    assert t.startswith("cpu-x86_64-avx512-") and t != cpu_target("x86_64", "AVX2", OLD_KERNEL)


def test_aarch64_features_without_the_kernels_own():
    base = "fp asimd aes pmull sha1 sha2 crc32 atomics asimdrdm lrcpc dcpop asimddp sve sve2 i8mm bf16"
    a = f"processor\t: 0\nFeatures\t: {base} evtstrm cpuid\nCPU implementer\t: 0x41\n"
    b = f"processor\t: 0\nFeatures\t: {base}\nCPU implementer\t: 0x41\n"
    assert cpu_target("aarch64", "DEFAULT", a) == cpu_target("aarch64", "DEFAULT", b)
    assert cpu_target("aarch64", "DEFAULT", b) != cpu_target("aarch64", "DEFAULT", b.replace(" sve2", ""))


def test_no_flags_line_is_an_empty_flag_set():
    assert isa_flags("processor\t: 0\n") == []
