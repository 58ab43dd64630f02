"""The memory and CPUs a process's cgroups allow: the kernel's files parsed, and the tightest limit taken. Pure.

psutil and sched_getaffinity describe the node. In a container (infra/compose.yaml runs hosts in them)
the kernel OOM-kills a process at its cgroup's memory limit and throttles it at its CPU quota, whatever
the node has free. kiln.host.machine.probe reads the files; this module turns their text into figures.

Where the files are: /proc/self/cgroup names the process's cgroup per hierarchy ("0::/path" for v2,
"N:memory:/path" for v1); /proc/self/mountinfo says where each hierarchy is mounted and which cgroup
the mount shows at its top (a container often sees its own cgroup there). A limit set on an ancestor
binds too, so every cgroup from the process's up to the mount's top is read.

    v2 (cgroup2):  memory.max ("max" or bytes), memory.current, memory.stat's inactive_file;
                   cpu.max ("max PERIOD" or "QUOTA PERIOD", microseconds)
    v1 (cgroup):   memory.limit_in_bytes (about 2**63 when unlimited), memory.usage_in_bytes,
                   memory.stat's total_inactive_file; cpu.cfs_quota_us (-1: unlimited), cpu.cfs_period_us

Available in a cgroup = limit - (usage - inactive_file). Usage counts the page cache charged to the
cgroup; the kernel reclaims inactive file pages before it OOM-kills, so they are as available as the
node's MemAvailable (which psutil reports) counts its own reclaimable cache. Without them a host that
has just read a checkpoint would look full. Active file pages are left out, as the kubelet's working set
leaves them out: reclaiming them costs the pages being read now.

CPUs = ceil(quota / period), at least 1: a fractional CPU throttles a worker, it does not kill it, so it
is worth a worker (as the JVM and Go's runtime count it).
"""

from __future__ import annotations

import math
import posixpath
from dataclasses import dataclass

V1_UNLIMITED_BYTES = 2**62
"""v1 reports "no limit" as a page-rounded 2**63 - 1; anything this large limits nothing."""

HOST = "host"
"""The source of a figure no cgroup limits: the node's (psutil, sched_getaffinity)."""


@dataclass(frozen=True)
class CgroupMount:
    """One cgroup hierarchy as mounted: where, showing which cgroup at its top, v1 or v2."""

    mount_point: str
    root: str
    """The cgroup path the mount shows at `mount_point` ('/' unless a container sees only its own)."""
    version: int
    controllers: frozenset[str] = frozenset()
    """v1: the controllers of this hierarchy (memory, cpu, ...); v2 mounts carry them all."""


@dataclass(frozen=True)
class MemoryLimit:
    """One cgroup's memory limit: bytes it allows in all, bytes still available, and which file said so."""

    limit_bytes: int
    available_bytes: int
    source: str
    """e.g. 'cgroup v2 memory.max at /sys/fs/cgroup'."""


@dataclass(frozen=True)
class CpuLimit:
    """One cgroup's CPU quota, in CPUs (may be fractional)."""

    cpus: float
    source: str


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash in paths as octal escapes (\\040)."""
    for code in ("040", "011", "012", "134"):
        field = field.replace("\\" + code, chr(int(code, 8)))
    return field


def parse_mountinfo(text: str) -> list[CgroupMount]:
    """The cgroup mounts of a /proc/self/mountinfo text."""
    out = []
    for line in text.splitlines():
        pre, sep, post = line.partition(" - ")
        fields, tail = pre.split(), post.split()
        if not sep or len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        controllers = frozenset(tail[2].split(",")) if tail[0] == "cgroup" else frozenset()
        out.append(CgroupMount(mount_point=_unescape(fields[4]), root=_unescape(fields[3]),
                               version=2 if tail[0] == "cgroup2" else 1, controllers=controllers))
    return out


def parse_proc_cgroup(text: str) -> dict[str, str]:
    """controller -> the process's cgroup path from /proc/self/cgroup; '' names the v2 hierarchy."""
    out = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for c in controllers.split(",") if controllers else [""]:
            out[c] = path
    return out


def cgroup_dirs(controller: str, proc_cgroup: str, mountinfo: str) -> list[tuple[int, str]]:
    """(version, directory) of every cgroup whose `controller` limits can bind this process: its own
    cgroup in each hierarchy that carries `controller`, then each ancestor up to the mount's top.

    `proc_cgroup`, `mountinfo`: the texts of /proc/self/cgroup and /proc/self/mountinfo.
    """
    paths = parse_proc_cgroup(proc_cgroup)
    out = []
    for m in parse_mountinfo(mountinfo):
        key = "" if m.version == 2 else controller
        if key not in paths or (m.version == 1 and controller not in m.controllers):
            continue
        path, root = paths[key], m.root.rstrip("/")
        if path == root or path.startswith(root + "/"):
            rel = path[len(root):].strip("/")
        else:  # the process's cgroup lies outside what the mount shows: its top is the nearest we see
            rel = ""
        parts = rel.split("/") if rel else []
        for depth in range(len(parts), -1, -1):
            out.append((m.version, posixpath.join(m.mount_point, *parts[:depth])))
    return out


def _stat_field(stat: str | None, *names: str) -> int:
    """The first of `names` found in a memory.stat text (0 when none is)."""
    values = dict(line.split(None, 1) for line in (stat or "").splitlines() if len(line.split()) == 2)
    for name in names:
        if name in values:
            return int(values[name])
    return 0


def memory_limit(version: int, directory: str, *, limit: str | None, usage: str | None,
                 stat: str | None) -> MemoryLimit | None:
    """One cgroup's memory limit from its files' texts (None: a file absent); None when it sets none.

    `limit`: memory.max (v2) or memory.limit_in_bytes (v1); `usage`: memory.current or
    memory.usage_in_bytes (absent: counted as 0); `stat`: memory.stat, for its reclaimable file pages.
    """
    if limit is None or limit.strip() in ("", "max"):
        return None
    limit_bytes = int(limit)
    if version == 1 and limit_bytes >= V1_UNLIMITED_BYTES:
        return None
    used = int(usage) if usage and usage.strip() else 0
    reclaimable = _stat_field(stat, "inactive_file") if version == 2 \
        else _stat_field(stat, "total_inactive_file", "inactive_file")
    held = max(0, used - reclaimable)
    name = "memory.max" if version == 2 else "memory.limit_in_bytes"
    return MemoryLimit(limit_bytes=limit_bytes, available_bytes=max(0, limit_bytes - held),
                       source=f"cgroup v{version} {name} at {directory}")


def cpu_limit(version: int, directory: str, *, quota: str | None, period: str | None = None) -> CpuLimit | None:
    """One cgroup's CPU quota (None: it sets none). v2: `quota` is cpu.max's text ('QUOTA PERIOD');
    v1: cpu.cfs_quota_us's, with `period` cpu.cfs_period_us's."""
    if quota is None:
        return None
    if version == 2:
        fields = quota.split()
        if len(fields) != 2 or fields[0] == "max":
            return None
        quota_us, period_us = int(fields[0]), int(fields[1])
        name = "cpu.max"
    else:
        if period is None or not quota.strip() or int(quota) < 0:
            return None
        quota_us, period_us = int(quota), int(period)
        name = "cpu.cfs_quota_us"
    if quota_us <= 0 or period_us <= 0:
        return None
    return CpuLimit(cpus=quota_us / period_us, source=f"cgroup v{version} {name} at {directory}")


def effective_memory(*, node_available_bytes: int, node_total_bytes: int,
                     limits: list[MemoryLimit]) -> tuple[int, int, str]:
    """(available bytes, total bytes, source): the node's figures, or a cgroup's where it allows less.

    The source names the limit that set the available figure (HOST when none is tighter than the node).
    """
    total = min([node_total_bytes] + [lim.limit_bytes for lim in limits])
    tightest = min(limits, key=lambda lim: lim.available_bytes, default=None)
    if tightest is None or tightest.available_bytes >= node_available_bytes:
        return node_available_bytes, total, HOST
    return tightest.available_bytes, total, tightest.source


def effective_cpus(*, affinity_cpus: int, limits: list[CpuLimit]) -> tuple[int, str]:
    """(CPUs, source): the CPUs this process may run on, or a cgroup's quota rounded up where it allows fewer."""
    tightest = min(limits, key=lambda lim: lim.cpus, default=None)
    if tightest is None:
        return affinity_cpus, HOST
    quota_cpus = max(1, math.ceil(tightest.cpus))
    if quota_cpus >= affinity_cpus:
        return affinity_cpus, HOST
    return quota_cpus, f"{tightest.source} ({tightest.cpus:g} CPUs)"
