"""The fail-fast gate: decide who compiles what before anything compiles.

A pure function of every host's report and the recipe. It either returns a
`Plan` (host -> keys to compile and to download, workers, predicted seconds)
or raises `GateRefused` naming each short host, by how many MiB, and what
would fix it. No prefect, torch or boto3 import: unit-tested on paper layouts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kiln.core.errors import GateRefused
from kiln.core.plan.recipe import Recipe, where_to_set
from kiln.core.plan.sizing import device_required_mib, floor_with_margin, required_mib, worker_capacity


@dataclass(frozen=True)
class HostReport:
    """What one host says about itself before compilation."""

    name: str
    ranks: tuple[int, ...]
    available_mib: int
    """Host memory available now (psutil, or the process's cgroup where it allows less), or the user's
    assumed figure."""
    num_cpus: int
    target: str
    """Compile target fingerprint: hosts of one target can compile for each other."""
    unified: bool = True
    """Whether the host's device memory is its own pool (GB10, CPU-only hosts)."""
    device_free_mib: int | None = None
    """Free memory of the GPU compile workers use, probed (None without a GPU, or on unified memory)."""
    device: str = "cpu"
    """'cpu' or 'cuda': the device of the host's target. Only a CUDA export's workers take device memory."""
    local_keys: frozenset[str] = frozenset()
    """Forward keys the host's local cache already holds."""
    available_assumed: bool = False
    compile_s: float | None = None
    """Measured seconds per forward on this host, when known."""
    measured_worker_mib: int | None = None
    """A compile worker's measured peak for this graph and target, margin included (None: not measured)."""
    measured_peak_mib: int | None = None
    """That measured peak itself, before the margin (None: not measured)."""
    available_source: str = "host"
    """What set available_mib when probed: 'host' (the node's figure) or the cgroup file that limits it."""
    cpus_source: str = "host"
    """What set num_cpus: 'host' (the process's affinity) or the cgroup file whose quota limits it."""


@dataclass
class HostPlan:
    name: str
    target: str
    available_mib: int
    required_one_mib: int
    """Memory one worker needs on this host."""
    worker_mib: int
    """Host memory the gate counts per worker."""
    worker_mib_source: str
    """Where worker_mib comes from: 'measured' (this graph's peak), 'recipe' (set) or 'estimate'."""
    capacity: int
    """Workers memory and CPUs allow."""
    workers: int = 0
    """Workers the plan starts: capacity capped by the work assigned."""
    compile: list[str] = field(default_factory=list)
    download: list[str] = field(default_factory=list)
    predicted_s: float = 0.0
    worker_words: str = ""
    """worker_mib explained (gate.worker_words): the one figure the refusal, the summary and the picture show."""

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in ("name", "target", "available_mib", "required_one_mib", "worker_mib",
                                               "worker_mib_source", "worker_words", "capacity", "workers", "compile", "download",
                                               "predicted_s")}


@dataclass
class Plan:
    decision: str
    """'compile' or 'nothing_to_do'."""
    policy: str
    hosts: dict[str, HostPlan]
    predicted_s: float
    message: str

    @property
    def assignments(self) -> dict[str, list[str]]:
        return {name: list(h.compile) for name, h in self.hosts.items()}

    def to_dict(self) -> dict:
        return {"decision": self.decision, "policy": self.policy, "predicted_s": self.predicted_s,
                "assignments": self.assignments, "message": self.message,
                "hosts": {n: h.to_dict() for n, h in self.hosts.items()}}


def decide(hosts: list[HostReport], recipe: Recipe, needed: dict[str, list[str]],
           store_keys: set[str] | frozenset[str], *, compile_s: dict[str, float] | None = None,
           page_size_bytes: int | None = None, kv_pages_per_rank: int | None = None) -> Plan:
    """Plan the compile phase or refuse it.

    `needed` maps each target to the forward keys its ranks need; `store_keys`
    are keys already in the store; `compile_s` holds the seconds each key is expected to take to compile
    (kiln.core.plan.decisions.compile_estimates: measured for its graph, or the recipe's estimate).
    """
    if not hosts:
        raise GateRefused("no hosts reported; start at least one host (Dask worker) and try again.")
    names = [h.name for h in hosts]
    if len(set(names)) != len(names):
        raise GateRefused(f"host names must be distinct, got {names}.")
    compile_s = compile_s or {}
    plans = {h.name: HostPlan(
        name=h.name, target=h.target, available_mib=h.available_mib,
        required_one_mib=required_mib(recipe, 1, h.unified, h.measured_worker_mib, cuda=h.device == "cuda"),
        worker_mib=recipe.worker_host_source(h.measured_worker_mib)[0],
        worker_mib_source=recipe.worker_host_source(h.measured_worker_mib)[1],
        worker_words=worker_words(recipe, h.measured_worker_mib, h.measured_peak_mib, cuda=h.device == "cuda",
                                  unified=h.unified),
        capacity=worker_capacity(recipe, available_mib=h.available_mib, unified=h.unified, num_cpus=h.num_cpus,
                                 cuda=h.device == "cuda", device_free_mib=h.device_free_mib,
                                 measured_host_mib=h.measured_worker_mib))
        for h in sorted(hosts, key=lambda h: h.name)}
    by_name = {h.name: h for h in hosts}

    # Which hosts lack which keys, and which keys nobody has yet.
    short: list[HostReport] = []
    missing_by_target: dict[str, list[str]] = {}
    for h in hosts:
        want = needed.get(h.target, []) if h.ranks else []
        plans[h.name].download = sorted(k for k in want if k in store_keys and k not in h.local_keys)
        lacks = [k for k in want if k not in store_keys and k not in h.local_keys]
        if lacks and plans[h.name].capacity == 0 and recipe.policy == "fail":
            short.append(h)
    for target, keys in needed.items():
        missing = sorted({k for k in keys if k not in store_keys})
        if not missing:
            continue
        missing_by_target[target] = missing
        if not any(p.capacity > 0 for p in plans.values() if p.target == target):
            short.extend(h for h in hosts if h.target == target and h not in short)
    if short:
        figures = {h.name: {"available_mib": h.available_mib, "required_one_mib": plans[h.name].required_one_mib,
                            "short_mib": max(0, plans[h.name].required_one_mib - h.available_mib),
                            "worker_words": plans[h.name].worker_words,
                            "device_free_mib": h.device_free_mib,
                            "device_short_mib": _device_gap_mib(h, recipe)} for h in short}
        raise GateRefused(_refusal(short, plans, by_name, recipe, page_size_bytes, kv_pages_per_rank), figures)

    for target, missing in missing_by_target.items():
        _assign(missing, [p for p in plans.values() if p.target == target and p.capacity > 0],
                by_name, compile_s, recipe.compile_s_estimate)
    for p in plans.values():
        # A key this host compiles is not downloaded by it; a key it lacks that
        # another host compiles is downloaded after the outcome check.
        lacking = [k for k in needed.get(p.target, []) if by_name[p.name].ranks
                   and k not in by_name[p.name].local_keys and k not in p.compile]
        p.download = sorted(set(lacking))
    predicted = max((p.predicted_s for p in plans.values()), default=0.0)
    todo = sum(len(p.compile) for p in plans.values())
    decision = "compile" if todo else "nothing_to_do"
    message = (f"compile {todo} forward(s) on {sum(1 for p in plans.values() if p.compile)} host(s), "
               f"about {predicted:.0f} s" if todo else "every forward is already in the store")
    return Plan(decision, recipe.policy, plans, predicted, message)


def _assign(keys: list[str], compilers: list[HostPlan], by_name: dict[str, HostReport],
            compile_s: dict[str, float], estimate_s: float) -> None:
    """Longest-first list scheduling over every compiler slot.

    Each key goes to the slot where it finishes first; among equal finishes,
    to the host with the fewest keys so far, so idle hosts share the work.
    """
    slots = [[0.0, p.name, i] for p in compilers for i in range(p.capacity)]
    plans = {p.name: p for p in compilers}
    used: dict[str, set[int]] = {p.name: set() for p in compilers}
    for key in sorted(keys, key=lambda k: (-compile_s.get(k, estimate_s), k)):
        def finish(slot):
            return slot[0] + (compile_s.get(key) or by_name[slot[1]].compile_s or estimate_s)
        best = min(slots, key=lambda sl: (finish(sl), len(plans[sl[1]].compile), sl[1], sl[2]))
        best[0] = finish(best)
        plans[best[1]].compile.append(key)
        plans[best[1]].predicted_s = max(plans[best[1]].predicted_s, best[0])
        used[best[1]].add(best[2])
    for p in compilers:
        p.compile.sort()
        p.workers = len(used[p.name])


def worker_words(recipe: Recipe, measured_worker_mib: int | None, measured_peak_mib: int | None, *,
                 cuda: bool = False, unified: bool = True) -> str:
    """What one compile worker is counted at, and why: a set figure, a measured peak times the margin, or
    the estimate before any measurement; for a CUDA export also its device memory, out of the same pool
    (unified memory) or out of the device's (discrete GPU)."""
    mib, source = recipe.worker_host_source(measured_worker_mib)
    if source == "measured" and measured_peak_mib:
        why = f": its measured peak {measured_peak_mib} MiB x margin {recipe.worker_mib_margin:g}"
    elif source == "measured":
        why = f": measured peak x margin {recipe.worker_mib_margin:g}"
    elif source == "recipe":
        why = ", as set in the recipe"
    else:
        why = ", the estimate before anything was measured"
    device = ""
    if cuda and recipe.worker_device_mib:
        device = (f", + {recipe.worker_device_mib} MiB device memory" if unified
                  else f"; and {recipe.worker_device_mib} MiB of device memory on its GPU")
    return f"a worker counted at {mib} MiB{why}{device}"


def _limited(source: str) -> str:
    """'limited by <the cgroup file>' for a figure a cgroup set; '' for the node's own ('host')."""
    return "" if source == "host" else f"limited by {source}"


def _device_gap_mib(h: HostReport, recipe: Recipe) -> int:
    """MiB of device memory a discrete GPU lacks for one compile worker of a CUDA export (0: not short, or
    not a CUDA export on a discrete GPU with a known free figure)."""
    need = device_required_mib(recipe, 1, h.unified, cuda=h.device == "cuda")
    return max(0, need - h.device_free_mib) if need and h.device_free_mib is not None else 0


def _refusal(short: list[HostReport], plans: dict[str, HostPlan], by_name: dict[str, HostReport],
             recipe: Recipe, page_size_bytes: int | None, kv_pages_per_rank: int | None) -> str:
    lines = []
    for h in sorted(short, key=lambda h: h.name):
        p = plans[h.name]
        limit = _limited(h.available_source)
        assumed = " (assumed)" if h.available_assumed else f" ({limit})" if limit else ""
        gap = p.required_one_mib - h.available_mib
        measured = f" (headroom {recipe.floor_mib()} MiB + {p.worker_words})"
        if gap > 0:
            lines.append(f"{h.name} is {gap} MiB short of one compile worker: it has {h.available_mib} MiB "
                         f"available{assumed} but one worker needs {p.required_one_mib} MiB{measured}")
        elif _device_gap_mib(h, recipe) > 0:
            lines.append(f"{h.name} is {_device_gap_mib(h, recipe)} MiB of device memory short of one compile "
                         f"worker: it has {h.device_free_mib} MiB of device memory free on its GPU but one compile "
                         f"worker of a CUDA export needs {recipe.worker_device_mib} MiB of device memory there")
        else:
            cpus = f"{h.num_cpus} CPUs" + (f", {_limited(h.cpus_source)}" if h.cpus_source != "host" else "")
            lines.append(f"{h.name} can run no compile worker ({cpus})")
    fixes = []
    floors = [floor_with_margin(recipe, available_mib=h.available_mib, unified=h.unified,
                                cuda=h.device == "cuda", measured_host_mib=h.measured_worker_mib) for h in short]
    if all(f is not None for f in floors) and any(plans[h.name].required_one_mib > h.available_mib for h in short):
        fixes.append(_floor_fix(recipe, min(floors), short))
    lenders = {p.name: p.capacity for p in plans.values() if p.capacity > 0
               and any(p.target == h.target for h in short)}
    if recipe.policy == "fail" and lenders:
        who = ", ".join(f"{n} ({c} worker{'s' if c > 1 else ''})" for n, c in sorted(lenders.items()))
        fixes.append(f"{where_to_set('policy', 'borrow')}: they lend their forwards to {who}")
    frees = []
    for h in short:
        gap = plans[h.name].required_one_mib - h.available_mib
        if gap > 0:
            text = f"{gap} MiB on {h.name}"
            if page_size_bytes and h.ranks:
                # Only a remedy when the KV cache is large enough to give that much back.
                pages = math.ceil(gap * 2**20 / page_size_bytes / len(h.ranks))
                if kv_pages_per_rank is None or pages <= kv_pages_per_rank:
                    text += f" ({pages} fewer KV pages per rank)"
            frees.append(text)
        elif _device_gap_mib(h, recipe) > 0:
            frees.append(f"{_device_gap_mib(h, recipe)} MiB of device memory on {h.name}'s GPU")
    if frees:
        fixes.append("free " + ", ".join(frees))
    if not lenders:
        fixes.append("add a host of the same target with memory for a compile worker")
    return ("export refused before compiling: " + "; ".join(lines) + ". "
            + "To fix: " + "; or ".join(fixes) + ".")


def _floor_fix(recipe: Recipe, floor_mib: int, short: list[HostReport]) -> str:
    """The headroom floor to set, with what it leaves to spare on the tightest short host and the default."""
    spare = min(h.available_mib - floor_mib - recipe.worker_mib(h.unified, h.measured_worker_mib,
                                                                       cuda=h.device == "cuda") for h in short)
    default = Recipe.headroom_floor_mib
    margin = (f" with {spare} MiB to spare (Kiln keeps a margin of {recipe.worker_mib_margin:g} x a worker's "
              "memory)" if spare > 0 else " with nothing to spare")
    return (f"{where_to_set('headroom_floor_mib', floor_mib)}: that admits one worker on every short host"
            f"{margin}; the default is {default} MiB")


def check_kv(kv_pages_per_rank: int, *, need_pages: int, largest: str, batch: int, pages_per_seq: int,
             page_tokens: int, context_tokens: int, limiting: str) -> None:
    """Refuse an export whose KV cache cannot hold its largest bucket: it could serve nothing of that size.

    `need_pages` = batch x pages_per_seq of the largest bucket; `limiting` names the rank and host
    whose memory set the plan.
    """
    if kv_pages_per_rank >= need_pages:
        return
    raise GateRefused(
        f"export refused before compiling: the KV plan leaves {kv_pages_per_rank} pages per rank (limited by "
        f"{limiting}) but bucket {largest} needs {need_pages} ({batch} sequences x {pages_per_seq} pages of "
        f"{page_tokens} tokens for a context of {context_tokens}). To fix: fewer compile workers on that host "
        f"({where_to_set('max_compile_workers', 'N')}; the plan reserves their memory), smaller buckets (a smaller "
        f"largest batch), a shorter context ({where_to_set('max_context_tokens', 'N')}), or more memory on that "
        "host.")
