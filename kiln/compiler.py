"""AOTInductor compilation in a pool of spawned worker processes (never threads).

torch.export and Inductor keep process-global state (the FX tracing flag, mode
stacks), so concurrent compiles in one process race; each worker is its own
process, started with `spawn` and kept warm across forwards. A worker that
dies (OOM kill, SIGKILL) breaks the pool: the pool is rebuilt and the forwards
in flight are tried again, up to `max_attempts` each.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kiln.errors import KilnError

# Inductor options that go into every forward (and therefore into its key).
COMPILER_OPTIONS = {"aot_inductor.package_constants_in_so": False}
FORWARD_DEVICE = "cpu"
"""Where forwards run: `compile_forward` builds the model and its example inputs on the CPU."""


def compiler_options(gemm_backends: str | None) -> dict:
    """A forward's (or the tuning graph's) Inductor options: with `gemm_backends` (e.g. 'ATEN,TRITON'),
    max-autotune picks each GEMM's kernel among them by measured time; None compiles untuned."""
    if gemm_backends is None:
        return dict(COMPILER_OPTIONS)
    return {**COMPILER_OPTIONS, "max_autotune": True, "max_autotune_gemm_backends": gemm_backends}


@dataclass(frozen=True)
class CompileResult:
    key: str
    path: str
    sha256: str
    size_bytes: int
    compile_s: float
    pid: int
    autotune: dict | None = None
    """GEMMs autotuned ('selections'), candidates benchmarked during this compile ('benchmarked'), and
    the tuning timings installed in the worker ('tuning_timings'); None when compiled without max-autotune."""


def model_code_fingerprint() -> str:
    """sha256 of the model's source: a change to the graph's code changes every key."""
    import kiln.model
    return hashlib.sha256(Path(kiln.model.__file__).read_bytes()).hexdigest()[:16]


# Per worker process: the tuning entries it installed, and how many GEMMs Inductor autotuned.
_TUNING: dict | None = None
_SELECTIONS = 0


def _count_selection(*_args, **_kwargs) -> None:
    global _SELECTIONS
    _SELECTIONS += 1


def _warm(tuning_entries: dict | None = None) -> None:
    """Pool initializer: import torch once per worker and install the tuning results before any compile."""
    global _TUNING
    import torch  # noqa: F401
    from torch._inductor import select_algorithm

    import kiln.model  # noqa: F401
    from kiln import tuner

    select_algorithm.add_feedback_saver(_count_selection)
    _TUNING = tuning_entries
    if tuning_entries:
        tuner.install(tuning_entries)


def compile_forward(spec: dict, out_path: str) -> CompileResult:
    """Export one bucket's forward and compile it into a weightless AOTInductor package.

    Runs inside a spawned worker. The weights are random placeholders of the
    right shapes: the package holds no constants and the loader supplies the
    rank's real weights.
    """
    import torch
    from torch.export import Dim

    from kiln import tuner, tuning
    from kiln.config import ModelConfig
    from kiln.model import ShardedDecoder, example_inputs

    start = time.perf_counter()
    cfg = ModelConfig(**spec["graph"]["config"])
    tp = spec["graph"]["tp"]
    inputs = spec["inputs"]
    torch.manual_seed(0)
    model = ShardedDecoder(cfg, tp).eval()
    args = example_inputs(cfg, tp, inputs["batch"], inputs["tokens"], page_tokens=inputs["page_tokens"],
                          pages_per_seq=inputs["pages_per_seq"], num_pages=inputs["pages_per_seq"] + 2)
    num_pages = Dim("num_pages", min=2, max=1 << 24)
    with torch.no_grad():
        program = torch.export.export(model, args, dynamic_shapes=({}, {}, {2: num_pages}, {}))
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    tmp = f"{out_path.removesuffix('.pt2')}.tmp-{os.getpid()}.pt2"
    if _TUNING:
        tuner.install(_TUNING)  # again: another process may have rewritten Inductor's cache file since
    selections, benchmarked = _SELECTIONS, tuner.benchmark_count()
    torch._inductor.aoti_compile_and_package(program, package_path=tmp,
                                             inductor_configs=dict(spec["compiler"]))
    autotune = None
    if spec["compiler"].get("max_autotune"):
        autotune = {"selections": _SELECTIONS - selections, "benchmarked": tuner.benchmark_count() - benchmarked,
                    "tuning_timings": tuning.count_timings(_TUNING) if _TUNING else 0}
    digest = hashlib.sha256(Path(tmp).read_bytes()).hexdigest()
    os.replace(tmp, out_path)
    return CompileResult(key=spec["key"], path=out_path, sha256=digest, size_bytes=os.path.getsize(out_path),
                         compile_s=time.perf_counter() - start, pid=os.getpid(), autotune=autotune)


class CompileFailed(KilnError):
    """A forward could not be compiled within its attempts."""


class CompilePool:
    """A warm pool of spawned compile workers.

    `tuning_entries` (verified autotune entries, see kiln.tuner) are installed
    into every worker's Inductor cache when it starts, before it compiles.
    """

    def __init__(self, num_workers: int, *, max_attempts: int = 2, tuning_entries: dict | None = None):
        if num_workers < 1:
            raise ValueError("a compile pool needs at least one worker")
        self.num_workers = num_workers
        self.max_attempts = max_attempts
        self.tuning_entries = tuning_entries
        self._executor = self._new()

    def _new(self) -> ProcessPoolExecutor:
        return ProcessPoolExecutor(self.num_workers, mp_context=mp.get_context("spawn"), initializer=_warm,
                                   initargs=(self.tuning_entries,))

    def worker_pids(self) -> list[int]:
        return [p.pid for p in (self._executor._processes or {}).values()]

    def run(self, jobs: list[tuple[dict, str]], on_done: Callable[[CompileResult], None]) -> list[CompileResult]:
        """Compile every (spec, out_path); call `on_done` as each finishes (in this thread)."""
        attempts = {spec["key"]: 0 for spec, _ in jobs}
        pending = list(jobs)
        results: list[CompileResult] = []
        while pending:
            futures = {}
            for spec, out in pending:
                attempts[spec["key"]] += 1
                futures[self._executor.submit(compile_forward, spec, out)] = (spec, out)
            pending = []
            broken = False
            waiting = set(futures)
            while waiting:
                done, waiting = wait(waiting, return_when=FIRST_COMPLETED)
                for fut in done:
                    spec, out = futures[fut]
                    try:
                        result = fut.result()
                    except BrokenProcessPool:
                        broken = True
                        pending.append((spec, out))
                        continue
                    results.append(result)
                    on_done(result)
            if broken:
                # A worker died; the executor is unusable: start a fresh one and retry what was lost.
                self._executor.shutdown(wait=False, cancel_futures=True)
                self._executor = self._new()
                over = [s["key"] for s, _ in pending if attempts[s["key"]] >= self.max_attempts]
                if over:
                    raise CompileFailed(
                        f"forward {over[0]} killed its compile worker {self.max_attempts} times "
                        "(out of memory?); lower the number of workers or raise worker_host_mib.")
        return results

    def close(self) -> None:
        self._executor.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "CompilePool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
