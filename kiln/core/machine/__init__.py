"""A host's description: its compile target, CPU instruction sets, GPUs, cgroup limits and KILN_HOME.

Purpose: what a host is, parsed from the text it reports (`/proc/cpuinfo`,
cgroup files, NVML's answers), so the gate can compare hosts and a key can
name a target: `target` (cpu or cuda, fingerprinted), `cpu_target`, `gpus`,
`cgroup_limits`; and `home`, where this machine keeps Kiln's store, keys and
caches.

Contracts: pure functions of the text or values handed in (kiln.host.machine
does the reading); imports kiln.core.errors only, from outside this package.
"""
