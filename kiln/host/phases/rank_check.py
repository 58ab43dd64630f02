"""The in-flow check of each rank: load each forward with the rank's weights, in a process of its own, and
compare it with eager at its range's checked shapes; a check passed before is remembered, keyed by everything
that decided it (the forward's bytes, the rank, the checkpoint's content, the checker's code and settings)."""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from pathlib import Path

from kiln.core.errors import CheckCrashed, MemoryShort
from kiln.core.model.rank_bytes import weight_bytes_per_rank
from kiln.core.plan.deadlines import check_deadline
from kiln.core.plan.job import ExportJob, HostSpec
from kiln.core.plan.sizing import check_peak_mib
from kiln.core.run.outcome import passed
from kiln.host.compile import worker_start
from kiln.host.machine import cache, probe
from kiln.host.processes import faults
from kiln.host.machine.cache import cache_dir, local_path
from kiln.host.processes.procs import PeakSampler
from kiln.host.processes.spawned import ChildDied, call_in_spawned

log = logging.getLogger(__name__)

CHECK_SOURCES = (
    "kiln.host.ranks.loader",  # the comparison: inputs, eager runs, the judge, limits
    "kiln.host.ranks.routing_ties",  # which routing choices the dtype leaves open
    "kiln.core.forwards.shape_ranges",  # the shapes checked
    "kiln.core.run.outcome",  # the worst shape
    "kiln.host.weights",  # the reference's weights: reading, slicing, dequantizing
    "kiln.host.phases.rank_check",  # this module: what is checked and remembered
)
"""The checker's code: with the model's (kiln.host.compile.key_sources.KEY_SOURCES, the eager reference), what
a remembered check is keyed by, so a change to the checker or the reference checks every forward again."""


def check_ranks(job: ExportJob, host: HostSpec, forwards: list[dict]) -> dict[str, dict]:
    """Load each forward with each of this host's rank weights and compare with eager.

    Returns {'checks': 'rank<r>/<shapes>' -> {'diff', 'limit', 'at', ...} (the worst of the forward's range's
    checked shapes, kiln.host.ranks.loader.compare_at_shapes), 'memory':
    {'predicted_mib', 'peak_mib'} of the largest rank check}. A check that would not fit in the
    host's available memory is refused (MemoryShort) before its process starts.

    Each rank runs in its own spawned process, as it would when serving:
    loading native code must not be able to take the orchestrating process
    down, and AOTInductor crashes when one process loads a package twice.
    A check passed before on this host is remembered in the host's cache and
    not run again when everything that decided it is the same (`decided_by`:
    the artifact's bytes, the rank, the checkpoint's content, the checker's and
    the reference's code, the tolerance and input settings). 'checkpoint' is
    the identity of a checkpoint directory as this host read it (file names,
    sizes, digests: the manifest records it); None for one in S3.
    A check whose process dies raises CheckCrashed, one past its deadline (kiln.core.plan.deadlines:
    its forwards and shard) DeadlinePassed; neither is retried. A forward this host cannot run
    (kiln.core.trust.manifest.cannot_run_here) is refused (BadInput) before any process starts.
    """
    from kiln.core.machine.target import device_of
    from kiln.core.trust.manifest import check_runs_here, rank_forwards
    from kiln.host.ranks.loader import LOADER_PRELOAD, limit_of
    from kiln.host.weights.rank_weights import fingerprint

    if forwards:  # a package for another CPU dies of SIGILL in its rank's process: refuse it before any starts
        check_runs_here(forwards, probe.detect_target(device_of(str(forwards[0].get("target")))),
                        f"host {host.name}")
    from kiln.host.weights.checkpoint import files_fingerprint
    from kiln.host.weights.rank_weights import directory_identity, is_s3

    digests = cache_dir(host) / "digests"
    content = None if is_s3(job.checkpoint) else directory_identity(job.checkpoint, digests)
    weights = (files_fingerprint(content["files"]) if content else
               fingerprint(job.checkpoint, s3_endpoint=job.s3_endpoint, digests=digests))
    decided = decided_by(job)
    record = cache_dir(host) / "verified"
    diffs: dict[str, dict] = {}
    todo: dict[int, list[dict]] = {}
    for rank in host.ranks:
        for f in rank_forwards(forwards, rank):  # where shares differ, the forwards of its rank shape
            seen = _record_path(record, f, job.tp, rank, weights, decided)
            check = cache.read_record(seen)
            # The measured figures are remembered (an unreadable record counts as none); the limit is this export's.
            if check is not None and isinstance(check.get("diff"), (int, float)):
                check["remembered"] = check.pop("verified_at", None) or _mtime_iso(seen)
                check["limit"] = limit_of(check.get("own"), atol=job.recipe.verify_atol,
                                          half_ratio=job.recipe.verify_half_ratio)
                diffs[f"rank{rank}/{f['shapes']}"] = check
            else:
                todo.setdefault(rank, []).append(f)
    memory = {"predicted_mib": None, "peak_mib": None}
    if not todo:
        return {"checks": diffs, "memory": memory, "checkpoint": content}
    memory["predicted_mib"] = check_memory(job, max(len(fs) for fs in todo.values()),
                                           probe.host_memory()["host_available_mib"], f"host {host.name}")
    memory["peak_mib"] = 0
    # Each check's process forks from a server that imported what a loader needs once, not a spawn that imports it.
    warm = worker_start.acquire(LOADER_PRELOAD)
    try:
        for rank, fs in todo.items():
            try:
                result = call_in_spawned(
                    _check_rank, job, host, rank, fs,
                    deadline=check_deadline(len(fs), weight_bytes_per_rank(job.model_config, job.tp), job.recipe),
                    what=f"the check of rank {rank} on host {host.name} (forwards "
                         f"{', '.join(f['shapes'] for f in fs)})", context=warm)
            except ChildDied:
                raise CheckCrashed(
                    f"host {host.name}: the check of rank {rank} died (its process crashed loading or running a "
                    f"forward of shapes {', '.join(f['shapes'] for f in fs)}, or was killed); a crash is final, "
                    "not retried") from None
            found = {name: {**check, "checker": decided["checker"]} for name, check in result["checks"].items()}
            memory["peak_mib"] = max(memory["peak_mib"], result["peak_mib"])
            diffs.update(found)
            for f in fs:
                check = found[f"rank{rank}/{f['shapes']}"]
                if passed(check):
                    remember_check(_record_path(record, f, job.tp, rank, weights, decided),
                                   {**check, "verified_at": _mtime_iso(None)})
    finally:
        worker_start.release(warm)
    return {"checks": diffs, "memory": memory, "checkpoint": content}


@functools.lru_cache(maxsize=1)
def checker_code() -> str:
    """The fingerprint of the checker's and the eager reference's code (CHECK_SOURCES and the model's
    KEY_SOURCES; comments, docstrings and messages left out: kiln.host.compile.key_sources.code_fingerprint)."""
    from kiln.host.compile.key_sources import KEY_SOURCES, code_fingerprint
    return code_fingerprint(KEY_SOURCES + CHECK_SOURCES)


def decided_by(job: ExportJob) -> dict:
    """What decides a check's outcome besides the forward, the rank and the checkpoint: {'checker' (its code,
    `checker_code`), 'settings' (the recipe's tolerances and the inputs' paging), 'key' (16 hex characters
    over both: a remembered check's name carries it)}."""
    settings = {name: getattr(job.recipe, name) for name in
                ("verify_atol", "verify_half_ratio", "page_tokens", "pages_per_seq")}
    decided = {"checker": checker_code(), "settings": settings}
    return {**decided, "key": hashlib.sha256(json.dumps(decided, sort_keys=True).encode()).hexdigest()[:16]}


def _record_path(record: Path, forward: dict, tp: int, rank: int, weights: str, decided: dict) -> Path:
    """Where a passed check of `forward`'s bytes with rank `rank`'s weights (fingerprint `weights`) is kept, by
    a checker of `decided_by`'s key."""
    return record / f"{forward['sha256']}-tp{tp}-rank{rank}-{weights}-{decided['key']}.json"


def _check_rank(job: ExportJob, host: HostSpec, rank: int, forwards: list[dict]) -> dict:
    from kiln.core.forwards.shape_ranges import parse_shape_range
    from kiln.core.machine.target import device_of
    from kiln.host.ranks.loader import compare_at_shapes, load_forward, place_weights
    from kiln.host.compile import inductor_cache
    from kiln.host.ranks.verify_ranks import rank_device
    from kiln.host.model import solo_group
    from kiln.host.weights.rank_weights import load_rank_weights

    inductor_cache.use_for_loading()  # its probe of the CPU's vector ISA built once per host, not per check
    faults.point("check", rank)
    cfg = job.model_config
    diffs: dict[str, dict] = {}
    # One rank alone: its collectives sum over itself, in the compiled forward and in eager alike.
    # The export's forwards share one device (kiln.core.trust.manifest); rank r takes GPU r mod GPUs on a GPU host.
    device = rank_device(device_of(forwards[0]["target"]), rank) if forwards else "cpu"
    with PeakSampler(interval_s=0.1) as sampler, solo_group():
        # One copy of the rank's weights on its device, bound by every forward's package (kiln.host.ranks.loader).
        weights = place_weights(load_rank_weights(job.checkpoint, cfg, job.tp, rank, s3_endpoint=job.s3_endpoint,
                                                  cache_dir=cache_dir(host)), device)
        for f in forwards:
            compiled = load_forward(local_path(host, f["key"]), weights, f["sha256"], device=device)
            diffs[f"rank{rank}/{f['shapes']}"] = compare_at_shapes(
                compiled, cfg, job.tp, rank, weights, parse_shape_range(f["shapes"]),
                page_tokens=job.recipe.page_tokens, pages_per_seq=job.recipe.pages_per_seq,
                atol=job.recipe.verify_atol, half_ratio=job.recipe.verify_half_ratio, device=device)
    return {"checks": diffs, "peak_mib": sampler.peak_mib}


def check_memory(job: ExportJob, num_forwards: int, available_mib: int, what: str) -> int:
    """Predicted peak MiB of one rank's check; MemoryShort (before anything starts) when it cannot fit."""
    cfg = job.model_config
    need = check_peak_mib(shard_bytes=weight_bytes_per_rank(cfg, job.tp), num_forwards=num_forwards,
                          half=cfg.dtype != "float32", process_base_mib=job.recipe.process_base_mib)
    if need > available_mib:
        raise MemoryShort(f"{what}: checking one rank against eager needs about {need} MiB ({num_forwards} "
                          f"forward(s) of a {weight_bytes_per_rank(cfg, job.tp) // 2**20} MiB shard in {cfg.dtype}) "
                          f"but {available_mib} MiB are available; free memory there, or use a larger tp (a "
                          "smaller shard).")
    return need


def remember_check(path: Path, check: dict) -> None:
    """Keep a passed check in the host's cache; a write that fails only costs running it again next time."""
    try:
        cache.write_record(path, check)
    except OSError as exc:
        log.warning("could not remember a passed check in %s (%s): the next export will run it again",
                    path, exc.strerror or exc)


def _mtime_iso(path) -> str:
    """UTC time (seconds) of `path`'s last change, or now for None."""
    import datetime as dt

    when = dt.datetime.fromtimestamp(path.stat().st_mtime, dt.timezone.utc) if path else dt.datetime.now(dt.timezone.utc)
    return when.isoformat(timespec="seconds")
