"""The memory and CPUs a container allows, from recorded cgroup files laid out under a temporary root the
way the kernel shows them (/proc/self/cgroup, /proc/self/mountinfo, /sys/fs/cgroup). No container needed."""

from dataclasses import replace
from pathlib import Path

import pytest

from kiln.core.machine import cgroup_limits as cg
from kiln.core.plan.decisions import describe
from kiln.core.errors import GateRefused
from kiln.core.plan.gate import HostReport, decide
from kiln.core.plan.recipe import Recipe
from kiln.core.run.report import Report
from kiln.host.machine import probe

MIB = 2**20

V2_STAT = """anon 805306368
file 402653184
kernel 8388608
kernel_stack 1015808
shmem 0
file_mapped 16777216
file_dirty 0
active_anon 805306368
inactive_anon 0
active_file 134217728
inactive_file 268435456
unevictable 0
"""

# A container on cgroup v2 with its own cgroup namespace (Docker's default there): the process sees its
# cgroup as "/" and /sys/fs/cgroup is that cgroup. `docker run --memory 4g --cpus 1.5`.
DOCKER_V2 = {
    "proc/self/cgroup": "0::/\n",
    "proc/self/mountinfo":
        "1186 1185 0:148 / / rw,relatime - overlay overlay rw,lowerdir=/var/lib/docker/overlay2/l/A\n"
        "1187 1186 0:151 / /proc rw,nosuid,nodev,noexec,relatime - proc proc rw\n"
        "1191 1186 0:153 / /sys ro,nosuid,nodev,noexec,relatime - sysfs sysfs ro\n"
        "1192 1191 0:30 / /sys/fs/cgroup ro,nosuid,nodev,noexec,relatime - cgroup2 cgroup rw,nsdelegate,"
        "memory_recursiveprot\n",
    "sys/fs/cgroup/memory.max": "4294967296\n",
    "sys/fs/cgroup/memory.current": "1207959552\n",  # 1152 MiB, 256 MiB of it inactive file pages
    "sys/fs/cgroup/memory.stat": V2_STAT,
    "sys/fs/cgroup/cpu.max": "150000 100000\n",
}

# A systemd service on a cgroup v2 host, no namespace: the slice above the service sets the limit.
SYSTEMD_V2 = {
    "proc/self/cgroup": "0::/kiln.slice/kiln-worker.service\n",
    "proc/self/mountinfo": "35 24 0:30 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime shared:9 - cgroup2 cgroup2 "
                           "rw,nsdelegate,memory_recursiveprot\n",
    "sys/fs/cgroup/cgroup.controllers": "cpuset cpu io memory hugetlb pids rdma misc\n",  # the root: no memory.max
    "sys/fs/cgroup/kiln.slice/memory.max": "2147483648\n",
    "sys/fs/cgroup/kiln.slice/memory.current": "1610612736\n",
    "sys/fs/cgroup/kiln.slice/memory.stat": "inactive_file 0\n",
    "sys/fs/cgroup/kiln.slice/cpu.max": "max 100000\n",
    "sys/fs/cgroup/kiln.slice/kiln-worker.service/memory.max": "max\n",
    "sys/fs/cgroup/kiln.slice/kiln-worker.service/memory.current": "1073741824\n",
    "sys/fs/cgroup/kiln.slice/kiln-worker.service/cpu.max": "max 100000\n",
}

# A container on a cgroup v1 host without a cgroup namespace: /proc/self/cgroup names /docker/<id>,
# and each controller's mount shows that cgroup at its top. `docker run --memory 2g --cpus 2`.
DOCKER_V1 = {
    "proc/self/cgroup": "12:pids:/docker/0123abcd\n11:memory:/docker/0123abcd\n4:cpu,cpuacct:/docker/0123abcd\n"
                        "1:name=systemd:/docker/0123abcd\n0::/system.slice/containerd.service\n",
    "proc/self/mountinfo":
        "688 687 0:28 /docker/0123abcd /sys/fs/cgroup/cpu,cpuacct ro,nosuid,nodev,noexec,relatime master:12 - "
        "cgroup cgroup rw,cpu,cpuacct\n"
        "691 687 0:31 /docker/0123abcd /sys/fs/cgroup/memory ro,nosuid,nodev,noexec,relatime master:16 - "
        "cgroup cgroup rw,memory\n",
    "sys/fs/cgroup/memory/memory.limit_in_bytes": "2147483648\n",
    "sys/fs/cgroup/memory/memory.usage_in_bytes": "1610612736\n",
    "sys/fs/cgroup/memory/memory.stat": "cache 805306368\nrss 805306368\ninactive_file 1048576\n"
                                        "hierarchical_memory_limit 2147483648\ntotal_inactive_file 536870912\n",
    "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "200000\n",
    "sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n",
}

# Recorded on the machine these tests were written on: cgroup v1 memory and cpu, nothing limited
# (v1's "unlimited" is a page-rounded 2**63 - 1), cgroup2 mounted without controllers.
UNLIMITED_V1 = {
    "proc/self/cgroup": "9:name=systemd:/\n4:memory:/process_api/c27097561c5e\n1:cpu:/\n0::/\n",
    "proc/self/mountinfo":
        "31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755\n"
        "32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu\n"
        "35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory\n"
        "41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw\n",
    "sys/fs/cgroup/memory/memory.limit_in_bytes": "9223372036854771712\n",
    "sys/fs/cgroup/memory/process_api/memory.limit_in_bytes": "9223372036854771712\n",
    "sys/fs/cgroup/memory/process_api/c27097561c5e/memory.limit_in_bytes": "9223372036854771712\n",
    "sys/fs/cgroup/memory/process_api/c27097561c5e/memory.usage_in_bytes": "3002368\n",
    "sys/fs/cgroup/memory/process_api/c27097561c5e/memory.stat": "inactive_file 40960\ntotal_inactive_file 40960\n",
    "sys/fs/cgroup/cpu/cpu.cfs_quota_us": "-1\n",
    "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000\n",
    "sys/fs/cgroup/unified/cgroup.controllers": "",
}


def lay_out(root: Path, files: dict[str, str]) -> str:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return str(root)


def test_a_cgroup_v2_container_limits_memory_and_cpus(tmp_path):
    root = lay_out(tmp_path, DOCKER_V2)
    [mem] = probe.cgroup_memory_limits(root)
    assert mem == cg.MemoryLimit(limit_bytes=4096 * MIB, available_bytes=(4096 - 1152 + 256) * MIB,
                                 source="cgroup v2 memory.max at /sys/fs/cgroup")
    [cpu] = probe.cgroup_cpu_limits(root)
    assert cpu == cg.CpuLimit(cpus=1.5, source="cgroup v2 cpu.max at /sys/fs/cgroup")
    # The node has more than the container may use: the container's figures and their source.
    assert cg.effective_memory(node_available_bytes=60_000 * MIB, node_total_bytes=64_000 * MIB, limits=[mem]) == \
        (3200 * MIB, 4096 * MIB, "cgroup v2 memory.max at /sys/fs/cgroup")
    assert cg.effective_cpus(affinity_cpus=32, limits=[cpu]) == \
        (2, "cgroup v2 cpu.max at /sys/fs/cgroup (1.5 CPUs)")  # a fractional CPU still runs a worker
    # A node with less available than the cgroup allows: the node's figure, and 'host'.
    assert cg.effective_memory(node_available_bytes=1000 * MIB, node_total_bytes=64_000 * MIB, limits=[mem]) == \
        (1000 * MIB, 4096 * MIB, "host")
    assert cg.effective_cpus(affinity_cpus=2, limits=[cpu]) == (2, "host")


def test_an_ancestors_limit_binds(tmp_path):
    root = lay_out(tmp_path, SYSTEMD_V2)
    assert [d for _, d in cg.cgroup_dirs("memory", DOCKER_V2["proc/self/cgroup"], DOCKER_V2["proc/self/mountinfo"])] \
        == ["/sys/fs/cgroup"]
    assert [d for _, d in cg.cgroup_dirs("memory", SYSTEMD_V2["proc/self/cgroup"],
                                         SYSTEMD_V2["proc/self/mountinfo"])] == \
        ["/sys/fs/cgroup/kiln.slice/kiln-worker.service", "/sys/fs/cgroup/kiln.slice", "/sys/fs/cgroup"]
    [mem] = probe.cgroup_memory_limits(root)  # the service sets "max": only the slice limits
    assert mem.source == "cgroup v2 memory.max at /sys/fs/cgroup/kiln.slice"
    assert mem.available_bytes == 512 * MIB
    assert probe.cgroup_cpu_limits(root) == []  # "max": no quota


def test_a_cgroup_v1_container(tmp_path):
    root = lay_out(tmp_path, DOCKER_V1)
    # The mounts show the container's own cgroup at their top (root /docker/0123abcd): no /docker/... below.
    [mem] = probe.cgroup_memory_limits(root)
    assert mem == cg.MemoryLimit(limit_bytes=2048 * MIB, available_bytes=(2048 - 1536 + 512) * MIB,
                                 source="cgroup v1 memory.limit_in_bytes at /sys/fs/cgroup/memory")
    [cpu] = probe.cgroup_cpu_limits(root)  # found through the combined cpu,cpuacct hierarchy
    assert cpu == cg.CpuLimit(cpus=2.0, source="cgroup v1 cpu.cfs_quota_us at /sys/fs/cgroup/cpu,cpuacct")
    assert cg.effective_cpus(affinity_cpus=8, limits=[cpu]) == \
        (2, "cgroup v1 cpu.cfs_quota_us at /sys/fs/cgroup/cpu,cpuacct (2 CPUs)")


def test_no_limit_leaves_the_nodes_figures(tmp_path):
    root = lay_out(tmp_path, UNLIMITED_V1)
    assert probe.cgroup_memory_limits(root) == [] and probe.cgroup_cpu_limits(root) == []
    assert probe.host_memory(root)["memory_source"] == "host"
    assert probe.cpus_and_source(root)[1] == "host"
    empty = lay_out(tmp_path / "not-linux", {})  # no /proc at all
    assert probe.host_memory(empty)["memory_source"] == "host"


def test_the_probe_reports_the_cgroups_figures(tmp_path):
    files = dict(DOCKER_V2)
    files.update({"sys/fs/cgroup/memory.max": f"{64 * MIB}\n", "sys/fs/cgroup/memory.current": f"{40 * MIB}\n",
                  "sys/fs/cgroup/memory.stat": f"inactive_file {8 * MIB}\n"})  # far less than any node has free
    snap = probe.host_memory(lay_out(tmp_path, files))
    assert snap == {"host_available_mib": 64 - 40 + 8, "host_total_mib": 64,
                    "memory_source": "cgroup v2 memory.max at /sys/fs/cgroup"}


def test_parsing_edge_cases():
    [m] = cg.parse_mountinfo("40 31 0:38 / /mnt/with\\040space rw - cgroup2 cgroup2 rw\n")
    assert m.mount_point == "/mnt/with space" and m.version == 2
    assert cg.cpu_limit(2, "/x", quota="max 100000") is None
    assert cg.cpu_limit(1, "/x", quota="-1", period="100000") is None
    assert cg.cpu_limit(2, "/x", quota="20000 100000").cpus == 0.2
    assert cg.effective_cpus(affinity_cpus=4, limits=[cg.CpuLimit(0.2, "q")]) == (1, "q (0.2 CPUs)")
    assert cg.memory_limit(2, "/x", limit="max", usage="5", stat=None) is None
    # Usage below the reclaimable pages (never negative) and a usage file missing: the whole limit is available.
    assert cg.memory_limit(2, "/x", limit="100", usage="10", stat="inactive_file 50").available_bytes == 100
    assert cg.memory_limit(1, "/x", limit="100", usage=None, stat=None).available_bytes == 100
    # Outside what the mount shows (a namespaced view that lists a parent path): the mount's top.
    assert cg.cgroup_dirs("memory", "0::/../elsewhere\n", "1 1 0:1 /mine /sys/fs/cgroup rw - cgroup2 cgroup2 rw") \
        == [(2, "/sys/fs/cgroup")]


def test_the_refusal_plan_and_report_say_which_limit_applied():
    src = "cgroup v2 memory.max at /sys/fs/cgroup"
    hosts = [HostReport("a", (0,), available_mib=3000, num_cpus=8, target="t", available_source=src),
             HostReport("b", (1,), available_mib=60_000, num_cpus=0, target="t",
                        cpus_source="cgroup v1 cpu.cfs_quota_us at /sys/fs/cgroup/cpu (0.5 CPUs)")]
    recipe = Recipe(headroom_floor_mib=2048, recipe_headroom_mib=1024, policy="fail")
    with pytest.raises(GateRefused) as err:
        decide(hosts, recipe, {"t": ["k1"]}, set())
    msg = str(err.value)
    assert f"a is 72 MiB short of one compile worker: it has 3000 MiB available (limited by {src}) but" in msg
    assert "b can run no compile worker (0 CPUs, limited by cgroup v1 cpu.cfs_quota_us" in msg
    roomy = replace(hosts[0], available_mib=9000)
    assert f"a: available memory limited by {src}" in describe(decide([roomy], recipe, {"t": ["k1"]}, set()), [roomy])

    class Probe:  # what record_probes reads of a HostProbe
        name, target, cache, memory_source, cpus_source = "a", "t", {}, src, "host"
    report = Report("e", model="m", tp=1, store="file:///s")
    report.record_probes([Probe()])
    assert report.to_dict()["hosts"][0]["limits"] == {"memory": src, "cpus": "host"}
    assert f"- a: host available limited by {src}" in report.markdown()
