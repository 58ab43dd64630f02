"""The tensor-parallel sum inside a forward, and the process groups around it.

The cross-rank sum after a row-parallel projection is torch's native functional
collective (`_c10d_functional.all_reduce` + `wait_tensor`) on the process group
named TP_GROUP: AOTInductor compiles it to a C shim of libtorch, so a package
needs neither Python nor Kiln to run, and since the default world group has
that name on every rank, one package serves every rank. Compiling a shard, or
running one with tp > 1, therefore needs that group to exist: `solo_group`
makes a one-rank group for a process that runs alone (a compile worker, a
per-rank check), whose sums are then its own partial sums.

Every layer sums through `reduce` here, which looks `all_reduce` up when it runs,
so a bench can swap `kiln.host.model.layers.collectives.all_reduce` for another
collective before tracing.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F

from kiln.core.model.contract import PROCESS_GROUP as TP_GROUP


@contextlib.contextmanager
def solo_group():
    """A one-rank gloo world (group TP_GROUP) for the duration, unless this process already has one."""
    import torch.distributed as dist

    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def host_group():
    """A gloo group of every rank for the caller's own collectives, apart from TP_GROUP.

    The default world group belongs to the packages' collectives. Measured with
    torch 2.13 CPU and gloo: a Python broadcast or all_gather on that group between
    two calls of a package can leave the next call's all_reduce waiting forever
    (within a few steps); the same collectives on a group of their own never did.
    Call it on every rank, in the same order, after init_process_group.
    """
    import torch.distributed as dist

    return dist.new_group(backend="gloo")


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """Sum over the tensor-parallel group TP_GROUP (native ops: no Python inside a compiled package)."""
    return torch.ops._c10d_functional.wait_tensor(torch.ops._c10d_functional.all_reduce(x, "sum", TP_GROUP))


def reduce(x: torch.Tensor, tp: int) -> torch.Tensor:
    """x summed over the ranks; x itself at tp 1 (an unsharded model never reduces, even inside a process
    group: the reference check runs one)."""
    return all_reduce(x) if tp > 1 else x  # looked up at call time: a swapped all_reduce is the one called


def linear_then_reduce(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: int) -> torch.Tensor:
    """A row-parallel projection: partial products summed over the ranks, then the bias added once."""
    out = reduce(F.linear(x, weight), tp)
    return out if bias is None else out + bias
