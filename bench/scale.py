"""Scale on paper: the fail-fast gate for 64 hosts x 8 ranks x 67 buckets. Pure (no torch).

The buckets are the CUDA-graph capture sizes of a common serving engine
(vLLM's default: 1, 2, 4, then every multiple of 8 up to 512: 67 sizes), one
decode forward each. Hosts are GB10-like (unified memory, 20 CPUs) under the
incident's recipe settings (8 GiB floor, 4 GiB per worker), with available
memory spread deterministically over 10-20 GiB, so about a fifth of the hosts
can run no worker and lend, the others run one or two.
"""

from __future__ import annotations

import time

from bench.context import INCIDENT_SETTINGS
from kiln.core.plan.gate import HostReport, decide
from kiln.core.plan.recipe import Bucket, Recipe, recipe_from_text


def capture_sizes(max_size: int = 512) -> list[int]:
    """1, 2, 4, 8, 16, 24, ..., max_size: 67 sizes for 512."""
    return [s for s in (1, 2, 4) if s <= max_size] + list(range(8, max_size + 1, 8))


def scale_layout(*, num_hosts: int = 64, ranks_per_host: int = 8, compile_s: float = 20.0,
                 num_cpus: int = 20, policy: str = "borrow") -> dict:
    """Everything `kiln.core.plan.gate.decide` needs for the paper layout, plus a description of it."""
    buckets = tuple(Bucket(s, 1) for s in capture_sizes())
    # The incident's own hosts (GB10, a CUDA export on unified memory): 2048 MiB per worker plus its CUDA context.
    recipe = recipe_from_text(INCIDENT_SETTINGS, Recipe(buckets=buckets)).replace(
        policy=policy, compile_s_estimate=compile_s, worker_host_mib=2048, worker_device_mib=2048)
    target = "cuda-sm_121-cu13.0-triton3.6.0-armv8.2-a"
    keys = [f"fwd-{b.batch:03d}x{b.tokens}" for b in buckets]
    hosts = []
    for i in range(num_hosts):
        available_mib = 10240 + (i * 2741) % 10240  # deterministic spread: 10240 .. 20479 MiB
        hosts.append(HostReport(name=f"host-{i:02d}", ranks=tuple(range(i * ranks_per_host, (i + 1) * ranks_per_host)),
                                available_mib=available_mib, num_cpus=num_cpus, target=target, unified=True,
                                device="cuda"))
    return {"hosts": hosts, "recipe": recipe, "needed": {target: keys}, "store_keys": frozenset(),
            "compile_s": {k: compile_s for k in keys}, "num_ranks": num_hosts * ranks_per_host,
            "num_buckets": len(buckets)}


def simulate(compile_s: float, *, repeats: int = 5, num_hosts: int = 64, ranks_per_host: int = 8) -> dict:
    """Run the gate `repeats` times on the paper layout; its run times and its plan's figures."""
    layout = scale_layout(num_hosts=num_hosts, ranks_per_host=ranks_per_host, compile_s=compile_s)
    times_s, plan = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        plan = decide(layout["hosts"], layout["recipe"], layout["needed"], layout["store_keys"],
                      compile_s=layout["compile_s"])
        times_s.append(time.perf_counter() - start)
    hosts = plan.hosts.values()
    return {"gate_run_s": times_s, "predicted_s": plan.predicted_s, "per_forward_compile_s": compile_s,
            "num_hosts": num_hosts, "num_ranks": layout["num_ranks"], "num_buckets": layout["num_buckets"],
            "hosts_lending": sum(1 for h in hosts if h.capacity == 0),
            "hosts_compiling": sum(1 for h in hosts if h.compile),
            "compile_slots": sum(h.capacity for h in hosts),
            "forwards_compiled": sum(len(h.compile) for h in hosts)}
