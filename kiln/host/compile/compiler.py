"""AOTInductor compilation in a pool of worker processes (never threads).

torch.export and Inductor keep process-global state (the FX tracing flag, mode
stacks), so concurrent compiles in one process race; each worker is its own
process, forked from a server that imported torch, Inductor and Kiln once
(kiln.host.compile.worker_start: a fresh interpreter, no inherited threads or CUDA
context, the caller's environment) and kept warm across forwards; each keeps
Inductor's caches in this user's private directories
(kiln.host.compile.inductor_cache), checked before any worker starts. Each worker is a
single-process executor of its own, so a worker that dies (OOM kill, SIGKILL)
costs only the forward it was compiling: that worker is replaced and that
forward tried again, up to `max_attempts` times; forwards on other workers
carry on and finished ones are never compiled again. A forward that compiles
past its deadline (kiln.core.plan.deadlines: its compile estimate x the
margin, at least the floor) has its worker killed with its compiler children
and fails final, naming its key, shapes and host; it is not tried again.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import time
from collections import deque
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kiln.core.errors import DiskError, KilnError
from kiln.core.plan.deadlines import Deadline
from kiln.host.trust.package_check import package_calls
from kiln.host.compile import export_call, inductor_cache, worker_start
from kiln.host.processes import faults
from kiln.host.processes.procs import kill_tree
from kiln.core.errors import DISK_ERRNOS
from kiln.host.compile.inductor_options import inductor_env
from kiln.store import sha256_file


@dataclass(frozen=True)
class CompileResult:
    key: str
    path: str
    sha256: str
    size_bytes: int
    compile_s: float
    pid: int
    attempts: int = 1
    """Times the forward was submitted; more than 1 when a compile worker died on it."""
    peak_mib: int = 0
    """Largest resident memory of the worker and its compiler children while compiling this forward."""
    autotune: dict | None = None
    """GEMMs autotuned ('selections'), candidates benchmarked during this compile ('benchmarked'), and
    the tuning timings installed in the worker ('tuning_timings'); None when compiled without max-autotune."""
    calls: dict | None = None
    """What the package's wrapper calls (kiln.host.trust.package_check.PackageCalls.to_dict): whether it is Python-free."""
    device: str = "cpu"
    """The device the forward was compiled for (kiln.host.compile.inductor_options.forward_device)."""
    device_peak_mib: int = 0
    """A CUDA forward's worker's device memory at its peak: its context (device_context_mib; 0 when unknown)
    plus the most its caching allocator reserved while compiling this forward. 0 for a CPU forward."""
    device_context_mib: int | None = None
    """The worker's CUDA context, measured at its first CUDA call (kiln.host.machine.device_memory.start_cuda);
    None when unknown (no nvidia-ml-py) or for a CPU forward."""
    device_allocated_mib: int = 0
    """The most device memory the worker's tensors used while compiling this forward (within the peak)."""


# Per worker process: the tuning entries it installed, and how many GEMMs Inductor autotuned.
_TUNING: dict | None = None
_SELECTIONS = 0


def _count_selection(*_args, **_kwargs) -> None:
    global _SELECTIONS
    _SELECTIONS += 1


def _warm(dirs: inductor_cache.InductorDirs | None = None, tuning_entries: dict | None = None) -> None:
    """Pool initializer: arm the parent watch, point Inductor at the private `dirs`
    (kiln.host.compile.inductor_cache), hook Inductor's autotuning counter and install the tuning results
    before any compile. torch and Kiln are imported already (kiln.host.compile.worker_start.PRELOAD)."""
    global _TUNING
    from kiln.host.processes.procs import die_with_parent

    die_with_parent()  # a worker never outlives the pool's owner (it would hold memory the next gate measures)
    if dirs is not None:
        inductor_cache.use(dirs)  # before anything reads or writes Inductor's caches (tuner.install does)
    import warnings

    # torch 2.13's own export path deep-copies its deprecated pytree LeafSpec: a FutureWarning in every compile
    # worker. Nothing in Kiln uses LeafSpec, so only that message is silenced.
    warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated",
                            category=FutureWarning)
    import torch  # noqa: F401
    from torch._inductor import select_algorithm

    import kiln.host.model  # noqa: F401
    from kiln.host.compile import tuner

    select_algorithm.add_feedback_saver(_count_selection)
    _TUNING = tuning_entries
    if tuning_entries:
        tuner.install(tuning_entries)


def compile_forward(spec: dict, out_path: str) -> CompileResult:
    """Export one forward over its range of shapes and compile it into a weightless AOTInductor package.

    Runs inside a spawned worker, in the config's dtype. The weights are
    uninitialized placeholders of the right shapes and dtype: the package holds
    no constants and the loader supplies the rank's real weights. The result
    carries the worker's peak memory (itself and its compiler children, sampled) and, for a CUDA forward
    (the graph's 'device'), its device peak: the worker holds a CUDA context from its first CUDA forward on.
    """
    from kiln.host.compile.inductor_options import forward_device
    from kiln.host.model import solo_group
    from kiln.host.processes.procs import PeakSampler

    device = forward_device(spec["graph"])
    context = None
    if device != "cpu":
        from kiln.host.machine import device_memory

        context = device_memory.start_cuda(device)  # before anything else on the device: see device_memory
        device_memory.reset_peak(device)
    with PeakSampler() as sampler, solo_group():  # tracing the collectives resolves their group
        result = _compile_forward(spec, out_path)
    result = dataclasses.replace(result, peak_mib=sampler.peak_mib, device=device)
    if device == "cpu":
        return result
    peak = device_memory.allocator_peak(device)
    context_mib = None if context is None else -(-context // device_memory.MIB)
    return dataclasses.replace(result, device_peak_mib=(context_mib or 0) + peak["reserved_mib"],
                               device_context_mib=context_mib, device_allocated_mib=peak["allocated_mib"])


def _compile_forward(spec: dict, out_path: str) -> CompileResult:
    from kiln.core.plan import tuning_plan
    from kiln.host.compile import tuner

    start = time.perf_counter()
    _check_inductor_env(spec)
    _remove_stale_tmp(out_path)
    program = export_call.export_forward(spec)
    faults.point("compile", spec, "export")
    tmp = f"{out_path.removesuffix('.pt2')}.tmp-{os.getpid()}.pt2"
    if _TUNING:
        tuner.install(_TUNING)  # again: another process may have rewritten Inductor's cache file since
    selections, benchmarked = _SELECTIONS, tuner.benchmark_count()
    try:
        Path(out_path).parent.mkdir(parents=True, exist_ok=True)
        export_call.compile_package(program, tmp, spec["compiler"])
        faults.point("compile", spec, "written")
        digest = sha256_file(tmp)
        os.replace(tmp, out_path)
    except (OSError, RuntimeError) as exc:
        # torch's zip writer reports a short write (full disk) as RuntimeError("... unexpected pos ..."):
        # look at the disk while the partial file still fills it.
        full = _nearly_full(Path(tmp).parent)
        with contextlib.suppress(OSError):
            Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError) and exc.errno in DISK_ERRNOS:
            why, where = exc.strerror, exc.filename or tmp
        elif full is not None:
            why, where = f"No space left on device ({full} bytes free)", tmp
        else:
            raise
        raise DiskError(f"compiling forward {spec['key']} ({spec['shapes']}) failed writing {where}: {why}; "
                        "free space there or point KILN_CACHE_DIR (the host's cache) or KILN_INDUCTOR_DIR "
                        "(the compiler's caches and scratch) at a disk with room.") from None
    autotune = None
    if spec["compiler"].get("max_autotune"):
        autotune = {"selections": _SELECTIONS - selections, "benchmarked": tuner.benchmark_count() - benchmarked,
                    "tuning_timings": tuning_plan.count_timings(_TUNING) if _TUNING else 0}
    return CompileResult(key=spec["key"], path=out_path, sha256=digest, size_bytes=os.path.getsize(out_path),
                         compile_s=time.perf_counter() - start, pid=os.getpid(), autotune=autotune,
                         calls=package_calls(out_path).to_dict())


def _check_inductor_env(spec: dict) -> None:
    """Refuse to compile a forward whose key was made for other TORCHINDUCTOR_* settings than this worker's.

    Another host of the target may compile a key: its environment, which its workers inherit, must be the
    one the key hashes (kiln.host.compile.inductor_options.inductor_env), or the package would not be what the key
    names. A spec without 'inductor_env' was made for none.
    """
    keyed, here = spec["graph"].get("inductor_env", {}), inductor_env()
    if here != keyed:
        differ = sorted(k for k in {*keyed, *here} if keyed.get(k) != here.get(k))
        raise KilnError(f"forward {spec['key']} ({spec.get('shapes', '?')}) was keyed for the Inductor "
                        f"environment {keyed}, but this compile worker runs with {here} (differing: "
                        f"{', '.join(differ)}); set the same TORCHINDUCTOR_* variables on every host of target "
                        f"{spec.get('target', '?')} (or none) and export again.")


def _nearly_full(directory: Path, threshold_bytes: int = 1 << 20) -> int | None:
    """Free bytes of the disk holding `directory` when below `threshold_bytes`, else None."""
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        return None
    return free if free < threshold_bytes else None


def _remove_stale_tmp(out_path: str) -> None:
    """Remove partial packages of this forward left by workers that died (their pid is gone)."""
    out = Path(out_path)
    for tmp in out.parent.glob(f"{out.name.removesuffix('.pt2')}.tmp-*.pt2") if out.parent.is_dir() else []:
        pid = tmp.name.rsplit("tmp-", 1)[-1].removesuffix(".pt2")
        if pid.isdigit() and not _alive(int(pid)):
            tmp.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class CompileFailed(KilnError):
    """A forward could not be compiled within its attempts: its worker died `max_compile_attempts` times.

    Final (kiln.core.run.retry_rule): the pool's attempts are this failure's one level of retries."""


class CompilePool:
    """A warm pool of compile workers, one single-process executor per worker, each forked from the
    preloaded server for the environment at the time the pool is made (kiln.host.compile.worker_start).

    `compile_fn(spec, out_path) -> CompileResult` runs in the workers (a
    module-level function, so it pickles); `initializer` warms each new worker.
    `tuning_entries` (verified autotune entries, see kiln.host.compile.tuner) are installed
    into every worker's Inductor cache when it starts, before it compiles. With the default initializer,
    the workers' Inductor caches are this user's private directories, made and checked here
    (kiln.host.compile.inductor_cache.prepare: BadInput before any worker starts).
    `deadlines` (key -> Deadline) bounds each compile of a key (from its submission); `where` names the
    host in errors ('host h0').
    """

    def __init__(self, num_workers: int, *, max_attempts: int = 2,
                 compile_fn: Callable[[dict, str], CompileResult] = compile_forward,
                 initializer: Callable[..., None] | None = _warm, tuning_entries: dict | None = None,
                 deadlines: dict[str, Deadline] | None = None, where: str = "this host"):
        if num_workers < 1:
            raise ValueError("a compile pool needs at least one worker")
        self.num_workers = num_workers
        self.max_attempts = max_attempts
        self.worker_deaths = 0
        self._fn = compile_fn
        self._initializer = initializer
        self.tuning_entries = tuning_entries
        self.inductor_dirs = inductor_cache.prepare() if initializer is _warm else None
        self.deadlines = dict(deadlines or {})
        self.where = where
        self._ctx = worker_start.acquire()
        self._slots = [self._new() for _ in range(num_workers)]

    def _new(self) -> ProcessPoolExecutor:
        args = (self.inductor_dirs, self.tuning_entries) if self._initializer is _warm else ()
        return ProcessPoolExecutor(1, mp_context=self._ctx, initializer=self._initializer, initargs=args)

    def worker_pids(self) -> list[int]:
        return [p.pid for ex in self._slots for p in (ex._processes or {}).values()]

    def run(self, jobs: list[tuple[dict, str]], on_done: Callable[[CompileResult], None], *,
            on_submit: Callable[[dict], bool] | None = None, on_tick: Callable[[], None] | None = None,
            tick_s: float = 10.0) -> list[CompileResult]:
        """Compile every (spec, out_path); call `on_done` as each finishes (in this thread).

        `on_submit(spec)` is called (in this thread) just before a forward is first handed to a worker;
        False skips it (not compiled, not in the results). `on_tick()` is called at least every `tick_s`
        while forwards compile. A forward whose worker dies is retried on a fresh worker; after
        `max_attempts` deaths, on a compile error, or when a compile runs past its key's deadline (its
        worker is killed: DeadlinePassed, not retried), no new forward starts, the ones in flight finish
        (and reach `on_done`), then the error is raised.
        """
        attempts = {spec["key"]: 0 for spec, _ in jobs}
        queue = deque(jobs)
        free = list(range(self.num_workers))
        running: dict[Future, tuple[int, dict, str]] = {}
        due: dict[Future, float] = {}  # monotonic time each compile with a deadline must be done by
        overdue: set[Future] = set()
        results: list[CompileResult] = []
        error: BaseException | None = None
        while running or (queue and error is None):
            while queue and free and error is None:
                spec, out = queue.popleft()
                if not attempts[spec["key"]] and on_submit is not None and not on_submit(spec):
                    continue
                slot = free.pop()
                attempts[spec["key"]] += 1
                fut = self._slots[slot].submit(self._fn, spec, out)
                running[fut] = (slot, spec, out)
                if spec["key"] in self.deadlines:
                    due[fut] = time.monotonic() + self.deadlines[spec["key"]].seconds
            if not running:
                break
            done, _ = wait(running, timeout=self._wait_s(due, overdue, tick_s if on_tick else None),
                           return_when=FIRST_COMPLETED)
            if on_tick is not None:
                on_tick()
            for fut in done:
                slot, spec, out = running.pop(fut)
                due.pop(fut, None)
                try:
                    result = fut.result()
                except BrokenProcessPool:
                    # Only this slot's worker died, and it was compiling `spec`: replace it.
                    self._slots[slot].shutdown(wait=False, cancel_futures=True)
                    self._slots[slot] = self._new()
                    free.append(slot)
                    if fut in overdue:  # killed here, past its deadline: a hang would hang again
                        overdue.discard(fut)
                        error = error or self.deadlines[spec["key"]].passed(
                            f"the compile of forward {spec['key']} ({spec.get('shapes', '?')}) on {self.where}",
                            "its compile worker was killed with its compiler children")
                        continue
                    self.worker_deaths += 1
                    if attempts[spec["key"]] >= self.max_attempts:
                        error = error or CompileFailed(
                            f"forward {spec['key']} ({spec.get('shapes', '?')}) killed its compile worker "
                            f"{attempts[spec['key']]} times (max_compile_attempts={self.max_attempts}; out of "
                            "memory?); lower the number of workers or raise worker_host_mib.")
                    else:
                        queue.appendleft((spec, out))
                    continue
                except BaseException as exc:  # a deterministic compile error: not retried
                    free.append(slot)
                    error = error or exc
                    continue
                free.append(slot)
                result = dataclasses.replace(result, attempts=attempts[spec["key"]])
                results.append(result)
                on_done(result)
            self._stop_overdue(running, due, overdue)
        if error is not None:
            raise error
        return results

    @staticmethod
    def _wait_s(due: dict[Future, float], overdue: set[Future], tick_s: float | None) -> float | None:
        """How long to wait for a compile to finish: until the next tick or the next deadline, whichever
        comes first (None: no tick and no deadline pending)."""
        pending = [at - time.monotonic() for fut, at in due.items() if fut not in overdue]
        waits = [w for w in (tick_s, min(pending, default=None)) if w is not None]
        return max(0.0, min(waits)) if waits else None

    def _stop_overdue(self, running: dict[Future, tuple[int, dict, str]], due: dict[Future, float],
                      overdue: set[Future]) -> None:
        """Kill the worker (and its compiler children) of every compile past its deadline; its future then
        fails with BrokenProcessPool, which `run` reports as the deadline passed."""
        now = time.monotonic()
        for fut, at in due.items():
            if fut in overdue or at > now or fut.done():
                continue
            overdue.add(fut)
            slot = running[fut][0]
            for proc in list((self._slots[slot]._processes or {}).values()):
                kill_tree(proc.pid)

    def close(self) -> None:
        for ex in self._slots:
            ex.shutdown(wait=True, cancel_futures=True)
        if self._ctx is not None:
            worker_start.release(self._ctx)
            self._ctx = None

    def stop(self) -> None:
        """Kill every worker now, with its compiler children, dropping what they compile; then close."""
        for pid in self.worker_pids():
            kill_tree(pid)
        self.close()

    def __enter__(self) -> "CompilePool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
