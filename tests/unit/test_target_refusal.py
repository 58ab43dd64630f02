"""A package for a CPU this host cannot run is refused by name before anything is fetched or loaded
(kiln.core.machine.cpu_target.cannot_run, kiln.core.trust.manifest.forwards_for_host). Pure: host descriptions only."""

from __future__ import annotations

import pytest

from kiln.core.errors import BadInput, IntegrityError
from kiln.core.machine.cpu_target import CpuIsa, cannot_run, cpu_isa
from kiln.core.machine.target import Target, cpu_target_of
from kiln.core.forwards.shape_ranges import parse_shape_range
from kiln.core.trust.manifest import build_manifest, check_manifest, check_runs_here, forwards_for_host

HASWELL = ("fpu cx8 cmov mmx fxsr sse sse2 pni ssse3 sse4_1 sse4_2 popcnt aes pclmulqdq avx avx2 fma f16c bmi1 "
           "bmi2 movbe xsave lm")
SKYLAKE_X = f"{HASWELL} avx512f avx512dq avx512cd avx512bw avx512vl"
SAPPHIRE_RAPIDS = f"{SKYLAKE_X} avx512_bf16 avx512_fp16 amx_tile amx_bf16 amx_int8"
GRACE = "fp asimd aes pmull sha1 sha2 crc32 atomics asimdrdm lrcpc dcpop asimddp sve sve2 i8mm bf16"


def _cpu(machine: str, level: str, flags: str) -> CpuIsa:
    key = "Features" if machine == "aarch64" else "flags"
    return cpu_isa(machine, level, f"processor\t: 0\n{key}\t\t: {flags} hypervisor pti\n")


AVX2 = _cpu("x86_64", "AVX2", HASWELL)
AVX512 = _cpu("x86_64", "AVX512", SKYLAKE_X)
AMX = _cpu("x86_64", "AVX512", SAPPHIRE_RAPIDS)
ARM = _cpu("aarch64", "SVE256", GRACE)


def _host(cpu: CpuIsa) -> Target:
    return cpu_target_of(machine=cpu.arch, cpu=cpu.fingerprint, torch_version="2.13.0", cpu_isa=cpu)


def _forward(key: str, cpu: CpuIsa, shapes: str = "1x8", *, described: bool = True) -> dict:
    return {"key": key * 16, **parse_shape_range(shapes).to_dict(), "target": cpu.fingerprint,
            "object": f"forwards/{key * 16}.pt2", "sha256": "a" * 64, "python_free": True,
            "interface": {"process_group": "0"}, **({"target_cpu": cpu.to_dict()} if described else {})}


def _manifest(forwards: list[dict]) -> dict:
    return check_manifest(build_manifest(export_id="e", model={}, recipe={}, tp=2, buckets=[], forwards=forwards,
                                         weights={}, kv_plan={}, hosts=[], phases=[],
                                         signing={"signed": False, "key_fingerprint": None}))


def test_a_cpu_runs_code_for_its_own_cpu_or_a_lower_one_of_its_architecture():
    assert cannot_run(AVX2, AVX512) is None  # a baseline package on a newer CPU
    assert cannot_run(AVX512, AMX) is None and cannot_run(AVX512, AVX512) is None
    assert cannot_run(AVX512, AVX2) == "it needs ISA level avx512 and this CPU's is avx2"
    assert cannot_run(AMX, AVX512) == ("it needs instruction sets this CPU lacks (amx_bf16, amx_int8, amx_tile, "
                                       "avx512_bf16, avx512_fp16)")  # one ISA level, more instruction sets
    assert cannot_run(AVX2, ARM) == "it is x86_64 code and this CPU is aarch64"
    assert cannot_run(ARM, AVX512) == "it is aarch64 code and this CPU is x86_64"


def test_the_description_is_the_fingerprints_cpu_and_reads_back():
    assert AVX512.fingerprint.startswith("cpu-x86_64-avx512-") and "pti" not in AVX512.flags
    assert CpuIsa.from_dict(AVX512.to_dict()) == AVX512
    with pytest.raises(ValueError, match="not a CPU description"):
        CpuIsa.from_dict({"arch": "x86_64", "isa_level": "avx2", "isa_flags": ["sse2", "avx"]})  # unsorted
    with pytest.raises(ValueError, match="is not the target's CPU"):
        cpu_target_of(machine="x86_64", cpu=AVX2.fingerprint, torch_version="2.13.0", cpu_isa=AVX512)


def test_an_avx512_package_on_an_avx2_host_is_refused_naming_both_and_the_fix():
    m = _manifest([_forward("a", AVX512), _forward("b", AVX512, "2x8")])
    with pytest.raises(BadInput) as info:
        forwards_for_host(m, _host(AVX2), 0)
    said = str(info.value)
    assert f"export e has no forward of shapes 1x8 for this host's target {AVX2.fingerprint} (x86_64, ISA level avx2)" in said
    assert f"forward {'a' * 16} is for {AVX512.fingerprint}: it needs ISA level avx512 and this CPU's is avx2" in said
    assert "To fix: run it on a host of one of those targets" in said and "export again with a host of this one" in said


def test_an_avx2_package_on_an_avx512_host_is_taken():
    m = _manifest([_forward("a", AVX2), _forward("b", AVX2, "2x8")])
    assert [f["key"] for f in forwards_for_host(m, _host(AVX512), 0)] == ["a" * 16, "b" * 16]


def test_x86_64_packages_on_an_aarch64_host_are_refused():
    m = _manifest([_forward("a", AVX2), _forward("b", AVX512)])
    with pytest.raises(BadInput, match=f"host's target {ARM.fingerprint} \\(aarch64, ISA level sve256\\): forward a+ "
                                       f"is for {AVX2.fingerprint}: it is x86_64 code and this CPU is aarch64; "
                                       "forward b+ is for .*: it is x86_64 code"):
        forwards_for_host(m, _host(ARM), 0)


def test_of_several_runnable_forwards_a_host_takes_its_own_then_the_highest_isa():
    m = _manifest([_forward("a", AVX2), _forward("b", AVX512), _forward("c", AMX)])
    assert [f["key"] for f in forwards_for_host(m, _host(AVX512), 0)] == ["b" * 16]  # its own
    assert [f["key"] for f in forwards_for_host(m, _host(AVX2), 0)] == ["a" * 16]
    newer = _cpu("x86_64", "AVX512", f"{SAPPHIRE_RAPIDS} avx10_1")  # another CPU: no forward of its own
    assert [f["key"] for f in forwards_for_host(m, _host(newer), 0)] == ["c" * 16]
    zen3 = _cpu("x86_64", "AVX2", f"{HASWELL} sse4a clzero")
    assert [f["key"] for f in forwards_for_host(m, _host(zen3), 0)] == ["a" * 16]


def test_a_forward_without_target_cpu_runs_only_on_its_own_target():
    # Manifests written before target_cpu: the fingerprint names the architecture and ISA level, not the flags.
    m = _manifest([_forward("a", AVX512, described=False)])
    assert [f["key"] for f in forwards_for_host(m, _host(AVX512), 0)] == ["a" * 16]
    with pytest.raises(BadInput, match="it needs ISA level avx512 and this CPU's is avx2"):
        forwards_for_host(m, _host(AVX2), 0)
    with pytest.raises(BadInput, match="records only its target's fingerprint, not the instruction sets"):
        forwards_for_host(m, _host(AMX), 0)
    with pytest.raises(BadInput, match="it is x86_64 code and this CPU is aarch64"):
        forwards_for_host(m, _host(ARM), 0)


def test_a_target_cpu_that_is_not_its_targets_is_refused_by_the_structure_check():
    lying = _forward("a", AVX2)
    lying["target_cpu"] = AVX512.to_dict()  # says AVX-512 of an AVX2 package: its fingerprint gives it away
    with pytest.raises(IntegrityError, match=f"describes {AVX512.fingerprint}, not its target {AVX2.fingerprint}"):
        _manifest([lying])
    broken = {**_forward("a", AVX2), "target_cpu": {"arch": "x86_64"}}
    with pytest.raises(IntegrityError, match="its target_cpu is malformed"):
        _manifest([broken])


def test_the_rank_check_refuses_a_package_before_loading_it():
    check_runs_here([_forward("a", AVX2)], _host(AVX512), "host h0")
    with pytest.raises(BadInput, match=f"host h0: forward a+ \\(1x8\\) is for target {AVX512.fingerprint} and this "
                                       f"host's is {AVX2.fingerprint}: it needs ISA level avx512"):
        check_runs_here([_forward("a", AVX512)], _host(AVX2), "host h0")


def test_ranks_of_unequal_shares_each_get_one_forward_per_shapes():
    """kiln.core.model.shares: an export whose ranks' shares differ lists a forward per rank shape, each naming
    its ranks; the consumer picks its rank's (rank_forwards), and a manifest that leaves a rank without one, or
    names ranks on some forwards only, is refused."""
    from kiln.core.trust.manifest import rank_forwards

    a, b = {**_forward("a", AVX2), "ranks": [0]}, {**_forward("b", AVX2), "ranks": [1]}
    m = _manifest([a, b])
    chosen = forwards_for_host(m, _host(AVX512), 0)
    assert sorted(f["key"] for f in chosen) == ["a" * 16, "b" * 16]  # one per shapes and rank shape
    assert [f["key"] for f in rank_forwards(chosen, 1)] == ["b" * 16]
    assert [f["key"] for f in rank_forwards([_forward("c", AVX2)], 1)] == ["c" * 16]  # an even export's: every rank
    with pytest.raises(IntegrityError, match=r"forwards of shapes 1x8 \(.*\) are for ranks \[0\], not each of "
                                             r"the 2"):
        _manifest([a])
    with pytest.raises(IntegrityError, match="some forwards of the manifest name their ranks and others do not"):
        _manifest([a, _forward("c", AVX2)])
    with pytest.raises(IntegrityError, match=r"its ranks \[2\] are not ranks of tp 2"):
        _manifest([a, {**b, "ranks": [2]}])
