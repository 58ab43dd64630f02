"""All ranks together: the compiled forwards under a real gloo group against the unsharded model.

Starts `tp` processes (never threads; kiln.host.compile.worker_start), each loading the same weightless
package with its own weight shard; the custom all-reduce inside the package
sums across them. Rank 0 compares the combined logits and the gathered new
KV entries with the unsharded eager model.

`spawn_ranks` (also `kiln run`'s) watches the ranks as well as their
results: a rank that dies without a word (a segfault, the OOM killer) ends
the wait within a second, named with its signal and what it last said it
was doing, and the others, which would wait on it in gloo, are stopped.
"""

from __future__ import annotations

import os
import shutil
import time
import traceback
from queue import Empty

from kiln.core.errors import IntegrityError, KilnError, RankDied, RanksTimedOut
from kiln.core.run.rank_exit import rank_died_message, ranks_timed_out_message
from kiln.host.processes import faults

DOING_BYTES = 200
"""Room for what a rank says it is doing (RankLink.doing), in bytes; longer text is cut."""
POLL_S = 0.5
"""How often spawn_ranks looks at the ranks' exit codes while no result comes."""
DEATH_GRACE_S = 2.0
"""How long a rank's error waits for another rank's death to show: a peer's gloo error follows a death."""


def join_ranks(rank: int, tp: int, rendezvous: str) -> None:
    """Join the gloo group of spawn_ranks' `tp` ranks as `rank`, meeting in the file `rendezvous` (a FileStore:
    no port picked free beforehand, which another process could take before rank 0 listens on it)."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=tp)


class RankLink:
    """A rank's line to spawn_ranks: its result on the queue all ranks share, and what it is doing now in
    shared memory of its own, which the parent reads even after the rank died without a word."""

    def __init__(self, rank: int, queue, doing):
        self.rank = rank
        self._queue = queue
        self._doing = doing

    def doing(self, what: str) -> None:
        """Say what this rank starts now ('running forward 4x32'); then fault point 'rank' (rank, what)."""
        self._doing.value = what.encode()[:DOING_BYTES - 1]
        faults.point("rank", self.rank, what)

    def report(self, status: str, payload) -> None:
        """Post this rank's result: status 'ok' (payload: the result), 'refused' (a KilnError's message) or
        'error' (a traceback)."""
        self._queue.put((self.rank, status, payload))


def _said(doing) -> str:
    return doing.value.decode(errors="replace")


def _rank_process(target, rank: int, tp: int, rendezvous: str, job: dict, link: RankLink) -> None:
    """A rank's process: it dies with its parent, its packages check every input's shape, and it posts
    `target(...)`'s result, or the refusal (a KilnError, e.g. a refused artifact: its message says it all)
    or the traceback that ended it."""
    from kiln.host.compile import inductor_cache
    from kiln.host.processes import scratch
    from kiln.host.processes.procs import die_with_parent

    die_with_parent()
    scratch.adopt()  # AOTInductor's extractions land in this rank's own directory, swept once it is gone
    inductor_cache.use_for_loading()  # its probe of the CPU's vector ISA built once per host, not per rank
    os.environ["AOTI_RUNTIME_CHECK_INPUTS"] = "1"  # a wrong shape raises instead of crashing or lying
    try:
        link.report("ok", target(rank, tp, rendezvous, job, link))
    except KilnError as exc:
        link.report("refused", str(exc))
    except BaseException:
        link.report("error", traceback.format_exc())


def rank_artifacts(artifacts: dict[str, dict], rank: int) -> dict[str, dict]:
    """Forward shapes -> the artifact rank `rank` loads (kiln.core.trust.manifest.rank_forwards: where the
    ranks' shares differ, the one for its rank shape)."""
    return {art.get("shapes", name): art for name, art in sorted(artifacts.items())
            if rank in art.get("ranks", [rank])}


def _check_rank(rank: int, tp: int, rendezvous: str, job: dict, link: RankLink) -> dict:
    from kiln.host.processes.procs import PeakSampler

    with PeakSampler(interval_s=0.1) as sampler:
        diffs = _check_together(rank, tp, rendezvous, job, link)
    return {"diffs": diffs, "peak_mib": sampler.peak_mib}


def _check_together(rank: int, tp: int, rendezvous: str, job: dict, link: RankLink) -> dict:
    import torch
    import torch.distributed as dist

    from kiln.core.model.config import ModelConfig
    from kiln.core.model.cache_layout import cache_layout
    from kiln.core.model.shares import rank_share
    from kiln.core.run.outcome import worst_shape
    from kiln.core.forwards.shape_ranges import parse_shape_range
    from kiln.host.ranks.loader import check_against_eager, load_forward, place_weights
    from kiln.host.weights.rank_weights import load_rank_weights
    from kiln.host.model import example_inputs, host_group

    torch.set_num_threads(1)
    link.doing("joining the gloo group")
    join_ranks(rank, tp, rendezvous)
    side = host_group()
    cfg = ModelConfig(**job["config"])
    device = rank_device(job.get("device", "cpu"), rank)
    link.doing("loading weights")
    weights = place_weights(load_rank_weights(job["checkpoint"], cfg, tp, rank, s3_endpoint=job.get("s3_endpoint")),
                            device)
    full = None
    if rank == 0:
        link.doing("loading the unsharded model's weights")
        full = load_rank_weights(job["checkpoint"], cfg, 1, 0, s3_endpoint=job.get("s3_endpoint"))
    layout = cache_layout(cfg, tp, job["page_tokens"] * job["pages_per_seq"], rank)
    kv_heads = rank_share(cfg, tp, rank).kv_heads  # the KV heads this rank caches (kiln.core.model.shares)
    spans = [rank_share(cfg, tp, r).kv_heads for r in range(tp)]
    diffs = {}
    for name, art in sorted(rank_artifacts(job["artifacts"], rank).items()):
        link.doing(f"loading forward {name}")
        compiled = load_forward(art["path"], weights, art["sha256"], device=device)
        shapes = {}
        for bucket in parse_shape_range(name).checked_shapes():  # every rank runs the same shapes, in order
            args = tuple(a.to(device) for a in example_inputs(
                cfg, 1, bucket.batch, bucket.tokens, page_tokens=job["page_tokens"],
                pages_per_seq=job["pages_per_seq"], num_pages=job["pages_per_seq"] * bucket.batch + 5, seed=7))
            cache = args[2]
            # Each rank caches its own KV heads, or (latent attention) every rank the same whole latent.
            shard = cache[..., kv_heads[0]:kv_heads[1], :].contiguous() if layout.sharded else cache
            link.doing(f"running forward {name} at {bucket}")
            with torch.no_grad():
                logits, new_kv, *picks = (o.cpu() for o in compiled(*args[:2], shard, *args[3:]))
            parts = _gathered_heads(new_kv, spans, side) if layout.sharded else _gathered(new_kv, tp, side)
            # every rank routes alike (its router and indexer are replicated): one rank's choices
            chosen = [_gathered(mine, tp, side) for mine in picks]
            if rank == 0:
                link.doing(f"running the unsharded eager model for {name} at {bucket}")
                every = _whole_heads(parts, spans) if layout.sharded else _same(parts)
                got = (logits, every, *(_same(c, "choices") for c in chosen))
                shapes[str(bucket)] = check_against_eager(got, cfg, 1, full, args, atol=job["atol"],
                                                           half_ratio=job["half_ratio"], device=device)
        if rank == 0:
            diffs[name] = worst_shape(shapes)
    link.doing("leaving the gloo group")
    dist.barrier(group=side)
    dist.destroy_process_group()
    return diffs


def _gathered(tensor, tp: int, side) -> list:
    """Every rank's `tensor` (the same shape on each), in rank order."""
    import torch
    import torch.distributed as dist

    parts = [torch.empty_like(tensor) for _ in range(tp)]  # the side group's gloo gathers host tensors
    dist.all_gather(parts, tensor.contiguous(), group=side)
    return parts


def _gathered_heads(new_kv, spans: list[tuple[int, int]], side) -> list:
    """Every rank's new entries [..., its KV heads, width], gathered: padded to the most heads any rank holds
    (gloo gathers equal shapes; shares may differ: kiln.core.model.shares), cut back to each rank's."""
    import torch.nn.functional as F

    most = max(b - a for a, b in spans)
    padded = F.pad(new_kv, (0, 0, 0, most - new_kv.shape[-2]))
    return [part[..., :b - a, :] for part, (a, b) in zip(_gathered(padded, len(spans), side), spans)]


def _whole_heads(parts: list, spans: list[tuple[int, int]]):
    """The unsharded new entries from each rank's KV heads (`spans`: [start, stop) of each rank's); a KV head
    two ranks hold (fewer KV heads than ranks) must agree on both, to its dtype's rounding (each rank projects
    it in a matrix of its own width, which may round alike or not)."""
    import torch

    heads = max(b for _, b in spans)
    out = [None] * heads
    rtol = 1e-4 if parts[0].dtype == torch.float32 else 2e-2
    for rank, (part, (a, _)) in enumerate(zip(parts, spans)):
        for i in range(part.shape[-2]):
            head = part[..., i, :]
            if out[a + i] is not None and not torch.allclose(
                    out[a + i].float(), head.float(), rtol=rtol, atol=rtol * float(head.float().abs().max())):
                raise IntegrityError(f"rank {rank}'s new entries of KV head {a + i} differ from another rank's; "
                                     "ranks that hold one KV head must compute it alike.")
            out[a + i] = head
    return torch.stack(out, dim=-2)


def _same(parts: list, what: str = "new replicated cache"):
    """What every rank computed alike (latent attention's entries, DeepSeek-V4's slots, the choices);
    IntegrityError when they differ."""
    import torch

    for rank, part in enumerate(parts[1:], start=1):
        if not torch.equal(part, parts[0]):
            raise IntegrityError(f"rank {rank}'s {what} differs from rank 0's; every rank must compute the same "
                                 "(what decides it is replicated).")
    return parts[0]


def rank_device(device: str, rank: int) -> str:
    """Where `rank` runs its forwards: the CPU, or for 'cuda' the rank's GPU, ranks sharing GPUs round-robin
    when there are fewer GPUs than ranks (gloo allows it; NCCL would refuse two ranks on one GPU)."""
    if device == "cpu":
        return "cpu"
    import torch

    return f"cuda:{rank % max(1, torch.cuda.device_count())}"


def verify_all_ranks(*, checkpoint: str, config: dict, tp: int, artifacts: dict[str, dict], page_tokens: int,
                     pages_per_seq: int, atol: float, half_ratio: float, s3_endpoint: str | None = None,
                     timeout_s: float = 600, device: str = "cpu") -> tuple[dict[str, dict], int]:
    """(forward shapes -> {'diff', 'limit', 'at'} of the compiled ranks combined against the unsharded eager
    model at the worst of the forward's checked shapes (kiln.host.ranks.loader.check_against_eager,
    kiln.core.run.outcome.worst_shape), the ranks' peak MiB added up); raises on any rank's error.

    `artifacts` maps forward shapes' name ('2-8x16-64@8x64', kiln.core.forwards.shape_ranges) to {'path', 'sha256'} of
    a verified local copy (cli.verify.fetch_verified_export's: one per rank shape where shares differ), compiled for
    `device` ('cpu' or 'cuda': each rank on its GPU, see rank_device; the group is gloo either way).
    """
    job = {"checkpoint": str(checkpoint), "s3_endpoint": s3_endpoint, "config": config, "artifacts": artifacts,
           "atol": atol, "half_ratio": half_ratio, "page_tokens": page_tokens, "pages_per_seq": pages_per_seq,
           "device": device}
    results = spawn_ranks(_check_rank, tp, job, timeout_s=timeout_s)
    return results[0]["diffs"], sum(r["peak_mib"] for r in results.values())


def spawn_ranks(target, tp: int, job: dict, *, timeout_s: float = 600,
                poll_s: float = POLL_S) -> dict[int, object]:
    """Run `target(rank, tp, rendezvous, job, link)` in `tp` processes of their own, which join one gloo group
    with join_ranks(rank, tp, rendezvous). They fork from kiln.host.compile.worker_start's server for
    LOADER_PRELOAD (a fresh interpreter that imported torch and the loader, nothing else), as fresh as a spawn.

    Each rank says what it starts with `link.doing(...)`; what `target` returns is its result, and a
    KilnError it raises its refusal (`_rank_process` posts them with `link.report(...)`, RankLink).
    Returns rank -> payload of every rank's 'ok', or raises, having stopped every rank still running
    (none is left waiting in gloo): IntegrityError for a refusal (its message says it all);
    RankDied when a rank ended without a result (noticed within `poll_s`, twice that for exit code 0),
    or when a rank's error came with another rank's death (the error, a peer's death seen from gloo,
    waits DEATH_GRACE_S for one); RanksTimedOut after `timeout_s` without every result; RuntimeError
    with the rank's traceback for any other error.
    """
    from kiln.host.compile import worker_start
    from kiln.host.processes import scratch
    from kiln.host.ranks.loader import LOADER_PRELOAD

    # The ranks fork from a server that imported what a loader needs once, not tp spawns that each import it.
    ctx = worker_start.acquire(LOADER_PRELOAD)
    try:
        return _run_ranks(ctx, target, tp, job, timeout_s=timeout_s, poll_s=poll_s)
    finally:
        worker_start.release(ctx)


def _run_ranks(ctx, target, tp: int, job: dict, *, timeout_s: float, poll_s: float) -> dict[int, object]:
    """spawn_ranks with the processes started by `ctx`."""
    from kiln.host.processes import scratch

    queue = ctx.Queue()
    doing = [ctx.RawArray("c", DOING_BYTES) for _ in range(tp)]
    meeting = scratch.mkdtemp("kiln-ranks-")
    rendezvous = os.path.join(meeting, "store")
    procs = [ctx.Process(target=_rank_process, args=(target, r, tp, rendezvous, job, RankLink(r, queue, doing[r])),
                         daemon=False) for r in range(tp)]
    for p in procs:
        p.start()
    results, silent_dead, finished = {}, set(), False
    deadline = time.monotonic() + timeout_s
    try:
        while len(results) < tp:
            try:
                rank, status, payload = queue.get(timeout=poll_s)
            except Empty:
                status = None
            if status is None:
                # A rank gone without a result is dead; one that exited 0 only if it is still silent on the
                # next look: its last words, posted just before a normal exit, may have been on their way.
                gone = {r: p.exitcode for r, p in enumerate(procs) if r not in results and p.exitcode is not None}
                for r in sorted(gone):
                    if gone[r] != 0 or r in silent_dead:
                        raise RankDied(rank_died_message(r, gone[r], _said(doing[r]), world_size=tp))
                silent_dead = set(gone)
                if time.monotonic() > deadline:
                    raise RanksTimedOut(ranks_timed_out_message(
                        timeout_s, {r: _said(doing[r]) for r in range(tp) if r not in results}))
                continue
            if status == "ok":
                results[rank] = payload
                continue
            if status == "refused":
                raise IntegrityError(f"rank {rank}: {payload}")
            _raise_if_crashed(procs, skip={rank, *results}, doing=doing, grace_s=DEATH_GRACE_S)
            raise RuntimeError(f"rank {rank} failed:\n{payload}")
        finished = True
    finally:
        _stop(procs, gently=finished)
        shutil.rmtree(meeting, ignore_errors=True)
        for p in procs:  # a rank killed, or stopped on its way out, could not remove its own directory
            if p.pid is not None:
                scratch.remove_if_gone(p.pid)
    return results


def _raise_if_crashed(procs: list, *, skip: set[int], doing: list, grace_s: float) -> None:
    """RankDied for the first rank not in `skip` that ends with a non-zero exit code within `grace_s`."""
    deadline = time.monotonic() + grace_s
    while True:
        for r, p in enumerate(procs):
            if r not in skip and p.exitcode not in (None, 0):
                raise RankDied(rank_died_message(r, p.exitcode, _said(doing[r]), world_size=len(procs)))
        if all(p.exitcode is not None for r, p in enumerate(procs) if r not in skip) or time.monotonic() > deadline:
            return
        time.sleep(0.1)


def _stop(procs: list, *, gently: bool) -> None:
    """Reap the ranks: after success each has 30 s to exit; after a failure the live ones are stopped now
    (SIGTERM, then SIGKILL after 5 s): a rank left waiting on a dead peer in gloo would never return."""
    for p in procs:
        if not gently and p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=30 if gently else 5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)
