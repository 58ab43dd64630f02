"""The cost of Python inside a package: one decode step at tp 2, native collective vs Python custom op.

Both packages are the tiny model's 1x1 forward compiled the same way but for
the all-reduce (bench.collective_step); two gloo ranks load both and time
`steps` steps of each, `reps` times, alternating which goes first.
"""

from __future__ import annotations

import json
import subprocess
import time

from bench import collective_step
from bench.context import Context
from bench.figures import median, ratio
from bench.runs import PYTHON


def packages(ctx: Context) -> dict:
    """This sample's two packages (`bench.collective_step compile`), compiled once: {'dir', 'compiled' (its
    compiled.json: what each calls and its compile seconds)}. The native one is the first compile of a fresh
    process with a fresh Inductor cache, as the depth part compiles each of its packages."""
    def make() -> dict:
        w = ctx.work
        out = w.path("collective", "packages")
        w.run("collective-compile", [PYTHON, "-m", "bench.collective_step", "compile", str(out)],
              w.env(inductor="collective", kiln_home="collective/home")).expect(0)
        return {"dir": out, "compiled": json.loads((out / "compiled.json").read_text())}
    return ctx.once("collective-packages", make)


def _wait_all(procs: list[subprocess.Popen], timeout_s: float) -> list[int | None]:
    """Each process's exit code within `timeout_s` in all; any still running then is killed (None)."""
    deadline = time.monotonic() + timeout_s
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            codes.append(None)
    return codes


def part_collective(ctx: Context) -> dict:
    w = ctx.work
    made = packages(ctx)
    out, compiled = made["dir"], made["compiled"]
    if not compiled["native"]["python_free"] or compiled["custom"]["python_free"]:
        raise RuntimeError(f"the two packages are not what this part compares: {compiled}")
    reps, steps = (3, 20) if ctx.s.quick else (max(5, ctx.s.reps), 100)
    rendezvous = w.path("collective", f"rendezvous-{time.time_ns()}")
    procs = [subprocess.Popen([PYTHON, "-m", "bench.collective_step", "rank", str(r), str(rendezvous), str(out),
                               str(reps), str(steps)], env=w.env(inductor="collective", kiln_home="collective/home"),
                              cwd=w.root, stdout=open(w.logs / f"collective-rank{r}.log", "wb"),
                              stderr=subprocess.STDOUT) for r in range(2)]
    codes = _wait_all(procs, collective_step.HANG_S + 120)
    if any(codes):
        raise RuntimeError(f"collective ranks exited {codes}; see {w.logs}/collective-rank*.log")
    samples = json.loads((out / "steps.json").read_text())
    native, custom = median(samples["native"]), median(samples["custom"])
    pairs = [ratio(n, c) for n, c in zip(samples["native"], samples["custom"])]
    return {"figures": {"python_free_step_ratio": median(pairs)}, "samples": {"python_free_step_ratio": pairs},
            "raw": {"step_s": samples, "median_step_s": {"native": native, "custom": custom},
                    "steps_per_sample": steps, "packages": compiled},
            "notes": "tiny model, bucket 1x1, tp 2 under gloo, one thread per rank; median seconds per step of "
                     "the Python-free package over the custom-op package in each sample (the two alternate which "
                     "goes first); the figure is the median of the per-sample ratios"}
