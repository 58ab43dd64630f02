"""Compile-worker sizing and KV-cache planning: pure arithmetic over MiB.

    required(n) = max(headroom_floor, recipe_headroom) + n * worker_pool
    workers     = largest n with required(n) <= available, capped by CPUs, by work and, on a discrete GPU,
                  by n * worker_device <= device free

    worker_pool = worker_host + worker_device   a CUDA export on unified memory (GB10): one pool
                = worker_host                   a CUDA export on a discrete GPU, and every CPU export

A CUDA compile worker holds a CUDA context and what Inductor makes real on the
device (worker_device_mib). On unified memory that comes out of the same pool
as the worker's host memory (the incident's formula); on a discrete GPU it
comes out of the device's free memory, checked separately. A CPU export's
workers touch no device and reserve no device memory, on any host.
"""

from __future__ import annotations

import math

from dataclasses import dataclass

from kiln.core.plan.recipe import Recipe


def required_mib(recipe: Recipe, num_workers: int, unified: bool, measured_host_mib: int | None = None, *,
                 cuda: bool) -> int:
    """Host memory needed to run `num_workers` compile workers (`measured_host_mib`: see Recipe.worker_mib;
    `cuda`: the export's target is a GPU)."""
    return recipe.floor_mib() + num_workers * recipe.worker_mib(unified, measured_host_mib, cuda=cuda)


def device_required_mib(recipe: Recipe, num_workers: int, unified: bool, *, cuda: bool) -> int:
    """Device memory `num_workers` compile workers need out of a discrete GPU's free memory (0 for a CPU
    export, and on unified memory, where required_mib counts it)."""
    return num_workers * recipe.worker_device_mib if cuda and not unified else 0


def worker_capacity(recipe: Recipe, *, available_mib: int, unified: bool, num_cpus: int, cuda: bool,
                    device_free_mib: int | None = None, measured_host_mib: int | None = None) -> int:
    """How many compile workers a host can run by memory (host, and device on a discrete GPU), CPUs and
    max_compile_workers (not yet capped by work). A discrete GPU whose free memory is unknown is not a limit."""
    by_host = max(0, (available_mib - recipe.floor_mib()) // recipe.worker_mib(unified, measured_host_mib,
                                                                               cuda=cuda))
    limits = [by_host, max(0, num_cpus)]
    if device_required_mib(recipe, 1, unified, cuda=cuda) > 0 and device_free_mib is not None:
        limits.append(max(0, device_free_mib // recipe.worker_device_mib))
    if recipe.max_compile_workers:
        limits.append(recipe.max_compile_workers)
    return min(limits)


def floor_admitting_one(recipe: Recipe, *, available_mib: int, unified: bool, cuda: bool,
                        measured_host_mib: int | None = None) -> int | None:
    """The largest headroom floor with which one worker fits, or None if lowering the floor cannot help."""
    floor = available_mib - recipe.worker_mib(unified, measured_host_mib, cuda=cuda)
    if floor < recipe.recipe_headroom_mib or floor <= 0:
        return None
    return floor


def floor_with_margin(recipe: Recipe, *, available_mib: int, unified: bool, cuda: bool,
                      measured_host_mib: int | None = None, step_mib: int = 256) -> int | None:
    """A headroom floor that admits one worker with room to spare: one worker's memory times
    worker_mib_margin (the margin Kiln keeps over a measured peak) below `available_mib`, rounded down to
    `step_mib`. Where that leaves less than the preparation headroom: the exact floor (floor_admitting_one);
    None if lowering the floor cannot help."""
    exact = floor_admitting_one(recipe, available_mib=available_mib, unified=unified, cuda=cuda,
                                measured_host_mib=measured_host_mib)
    if exact is None:
        return None
    worker = recipe.worker_mib(unified, measured_host_mib, cuda=cuda)
    floor = (available_mib - math.ceil(worker * recipe.worker_mib_margin)) // step_mib * step_mib
    return floor if floor >= recipe.recipe_headroom_mib and floor > 0 else exact


@dataclass(frozen=True)
class KvPlan:
    """Pages per rank (all ranks take the minimum) and the arithmetic behind them."""

    pages_per_rank: int
    page_bytes: int
    per_rank_pages: dict[int, int]
    """rank -> pages its host could hold, before taking the minimum."""
    limiting_rank: int

    def to_dict(self) -> dict:
        return {"pages_per_rank": self.pages_per_rank, "page_bytes": self.page_bytes,
                "per_rank_pages": {str(r): p for r, p in sorted(self.per_rank_pages.items())},
                "limiting_rank": self.limiting_rank}


def page_bytes(*, num_layers: int, kv_heads_per_rank: int, head_dim: int, page_tokens: int,
               dtype_bytes: int, entries: int = 2) -> int:
    """Bytes of one KV page of one rank: every layer's `entries` (keys and values; latent attention's one
    latent-and-rope-key entry, with 1 head of its width as head_dim)."""
    return entries * num_layers * kv_heads_per_rank * head_dim * page_tokens * dtype_bytes


def plan_kv(recipe: Recipe, *, page_size_bytes: int, weight_bytes_per_rank: int,
            hosts: list[tuple[list[int], int, int]]) -> KvPlan:
    """Pages per rank from each host's memory.

    `hosts` holds (ranks, memory_mib, pool_reservation_mib) per host: memory_mib
    is what the KV cache draws from (host available on unified memory, device
    free otherwise), pool_reservation_mib what the compile pool takes out of it.
    Each rank gets an equal share of what is left after every rank's weights and
    activation reserve; all ranks take the minimum, capped by `kv_max_pages`.
    """
    per_rank: dict[int, int] = {}
    for ranks, memory_mib, pool_mib in hosts:
        if not ranks:
            continue
        left_bytes = (memory_mib - pool_mib - len(ranks) * recipe.activation_reserve_mib) * 2**20 \
            - len(ranks) * weight_bytes_per_rank
        pages = max(0, left_bytes // len(ranks) // page_size_bytes)
        for r in ranks:
            per_rank[r] = min(int(pages), recipe.kv_max_pages)
    if not per_rank:
        return KvPlan(0, page_size_bytes, {}, -1)
    limiting = min(per_rank, key=lambda r: (per_rank[r], r))
    return KvPlan(per_rank[limiting], page_size_bytes, per_rank, limiting)


TRANSIENT_COPIES = 1
"""One more weights-sized allocation at a check's peak (loading and converting while the last copy lives);
calibrated on the Llama-3.2-1B-shaped bench (bench/scale_1b.py), where leaving it out under-predicted by 4-12%."""

FORWARD_FIXED_MIB = 16
"""What one loaded forward adds to a process beyond the weights it binds (its code, the runtime's own
state): 11.6 MiB per package measured by bench/rank_peak.py (a 4-layer package of hidden 768, float32)."""


def check_peak_mib(*, shard_bytes: int, num_forwards: int, half: bool, process_base_mib: int) -> int:
    """Predicted peak of one rank's check process (load every forward with the rank's weights, run eager).

    The rank's weights once (every package binds the same tensors: load_constants(user_managed=True), which
    every torch Kiln runs on takes), FORWARD_FIXED_MIB per loaded forward, the eager shard (for
    bfloat16/float16 also in float32: twice the bytes of a 16-bit shard; one eager model at a time) and
    TRANSIENT_COPIES.
    """
    copies = 1 + (2 if half else 1) + TRANSIENT_COPIES
    return process_base_mib + num_forwards * FORWARD_FIXED_MIB + -(-copies * shard_bytes // 2**20)


def verify_peak_mib(*, shard_bytes: int, full_bytes: int, tp: int, num_forwards: int, half: bool,
                    process_base_mib: int) -> int:
    """Predicted peak of `kiln verify` on one machine: tp rank processes at once, each holding its weights once
    and FORWARD_FIXED_MIB per forward, and rank 0 also the unsharded weights and the unsharded eager model
    (in float32 too for 16-bit exports) with TRANSIENT_COPIES of it."""
    ranks = tp * (process_base_mib + num_forwards * FORWARD_FIXED_MIB + -(-shard_bytes // 2**20))
    unsharded = -(-(1 + (2 if half else 1) + TRANSIENT_COPIES) * full_bytes // 2**20)
    return ranks + unsharded
