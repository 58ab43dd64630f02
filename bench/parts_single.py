"""Parts measured on one host: compile efficiency, pool vs loop, dedup, warm vs cold, overhead.

They share one cold `kiln export` (embedded Prefect API, local store, fresh
Inductor cache, the suite's buckets at tp 2), made once per suite run, and
the embedded API's start-up measured as a no-op flow with and without a
running server.
"""

from __future__ import annotations

import json

from bench.context import DEFAULT_COMPILE_S, Context
from bench.figures import compile_efficiency as efficiency
from bench.figures import less, median, ratio
from bench.runs import KILN, PYTHON, BenchFailed

COLD_NOTE = ("cold = fresh TORCHINDUCTOR_CACHE_DIR (no FX-graph, AOT-autograd or compiled-kernel cache), "
             "empty store, empty host cache; warm for every side alike: Inductor's machine-wide precompiled "
             "headers (built by the suite's warm-up), the OS page cache, Python bytecode, the tiny checkpoint")


def _phase(report: dict, name: str) -> float:
    return next(p["duration_s"] for p in report["phases"] if p["name"] == name)


def _export(ctx: Context, name: str, *, inductor: str) -> dict:
    w, s = ctx.work, ctx.s
    report = w.path("single", f"{name}.json")
    run = w.run(name, [*KILN, "export", "--model", ctx.model, "--tp", str(s.tp), "--buckets", s.buckets,
                       "--store", f"file://{w.path('single', 'store')}", "--report", str(report),
                       "--export-id", f"bench-{name}"],
                w.env(inductor=inductor, kiln_home="single/home")).expect(0)
    milestones = run.milestones({"flow_run_began_s": r"Beginning flow run",
                                 "flow_run_finished_s": r"Flow run '.*Finished in state"})
    return {"wall_s": run.wall_s, "report": json.loads(report.read_text()), "milestones_s": milestones}


def cold_export(ctx: Context) -> dict:
    """The suite's cold single-host export (made once)."""
    def make() -> dict:
        ctx.warm_up()
        return _export(ctx, "export-cold", inductor="export")
    return ctx.once("cold", make)


def startup(ctx: Context) -> dict:
    """Embedded Prefect API start-up: no-op flow without a server minus the same flow against one."""
    def make() -> dict:
        ctx.warm_up()
        embedded, server = [], []
        for i in range(ctx.s.reps):
            for name, store, use_server in (("embedded", embedded, False), ("server", server, True)):
                run = ctx.work.run(f"noop-flow-{name}-{i}", [PYTHON, "-m", "bench.noop_flow"],
                                   ctx.work.env(inductor=None, kiln_home="noop/home", server=use_server)).expect(0)
                store.append(run.wall_s)
        return {"noop_embedded_s": embedded, "noop_server_s": server,
                "embedded_api_startup_s": less(median(embedded), median(server))}
    return ctx.once("startup", make)


def measured_compile_s(ctx: Context) -> tuple[float, str]:
    """Median per-forward compile seconds of this run's cold export, or the default when it did not run."""
    if ctx.has("cold"):
        values = [f["compile_s"] for f in cold_export(ctx)["report"]["forwards"] if f["compile_s"]]
        if values:
            return median(values), "median per-forward compile_s of this run's cold export"
    return DEFAULT_COMPILE_S, "default (this run made no cold export)"


def loop_run(ctx: Context) -> dict:
    """The suite's plain compile loop over the cold export's buckets (made once); fails the part when it
    did not compile exactly the cold export's forward keys (then the two sides compare different work)."""
    cold = cold_export(ctx)

    def make() -> dict:
        w, s = ctx.work, ctx.s
        out = w.path("loop", "loop.json")
        run = w.run("loop-cold", [PYTHON, "-m", "bench.loop", "--model", ctx.model, "--tp", str(s.tp),
                                  "--buckets", s.buckets, "--out", str(w.path("loop", "out")), "--json", str(out)],
                    w.env(inductor="loop", kiln_home="loop/home")).expect(0)
        return {"wall_s": run.wall_s, **json.loads(out.read_text())}

    loop = ctx.once("loop", make)
    exported = sorted(f["key"] for f in cold["report"]["forwards"])
    if loop["keys"] != exported:
        raise BenchFailed(f"the loop compiled other forwards than the export: {loop['keys']} vs {exported}")
    return loop


def part_compile_efficiency(ctx: Context) -> dict:
    cold, loop = cold_export(ctx), loop_run(ctx)
    r = cold["report"]
    workers = sum(h["workers"] for h in r["hosts"])
    e = efficiency(list(loop["per_forward_compile_s"].values()), workers, _phase(r, "compile"))
    in_pool = [f["compile_s"] for f in r["forwards"] if f["compile_s"] is not None]
    return {"figures": {"compile_efficiency": e["efficiency"]},
            "raw": {**e, "workers_used": workers, "loop_per_forward_compile_s": loop["per_forward_compile_s"],
                    "pool_per_forward_compile_s": in_pool, "num_forwards": len(in_pool)},
            "notes": "the ideal is the loop's per-forward seconds (each forward alone on the machine) divided over "
                     "the workers the export used, so contention inside the pool shows as lost efficiency; the "
                     "compile phase's wall time includes spawning the pool's workers (torch import in each), "
                     f"uploads and the progress watcher's last poll. {COLD_NOTE}."}


def part_pool_vs_loop(ctx: Context) -> dict:
    cold, loop = cold_export(ctx), loop_run(ctx)
    return {"figures": {"pool_vs_loop_ratio": ratio(cold["wall_s"], loop["wall_s"]),
                        "pool_vs_loop_compile_ratio": ratio(_phase(cold["report"], "compile"), loop["compile_s"])},
            "raw": {"export_wall_s": cold["wall_s"], "loop_wall_s": loop["wall_s"], "loop": loop,
                    "export_compile_phase_s": _phase(cold["report"], "compile"), "same_forward_keys": True},
            "notes": "the export side is the whole `kiln export` (embedded API start-up, probe, gate, pool, "
                     "uploads, share + verify of every rank against eager, manifest); the loop compiles the "
                     "same graphs (the same keys, enforced) with kiln.host.compiler.compile_forward one after another "
                     f"in one process and does nothing else. {COLD_NOTE}."}


def part_dedup(ctx: Context) -> dict:
    r = cold_export(ctx)["report"]
    buckets = len({f["bucket"] for f in r["forwards"]})
    return {"figures": {"dedup_ratio": ratio(r["counts"]["compiled"], r["tp"] * buckets)},
            "raw": {"compiled": r["counts"]["compiled"], "tp": r["tp"], "buckets": buckets},
            "notes": "counts from the cold export's report: one artifact per bucket serves every rank"}


def part_warm_cold(ctx: Context) -> dict:
    cold = cold_export(ctx)
    st = startup(ctx)
    warm = ctx.once("warm", lambda: _export(ctx, "export-warm", inductor="export"))
    fixed = st["embedded_api_startup_s"]
    phases = {p["name"]: p["duration_s"] for p in warm["report"]["phases"]}
    return {"figures": {"warm_cold_ratio": ratio(warm["wall_s"], cold["wall_s"]),
                        "warm_cold_ratio_no_startup": ratio(less(warm["wall_s"], fixed), less(cold["wall_s"], fixed))},
            "raw": {"cold_wall_s": cold["wall_s"], "warm_wall_s": warm["wall_s"], "embedded_api_startup_s": fixed,
                    "warm_phases_s": phases, "warm_counts": warm["report"]["counts"],
                    "cold_milestones_s": cold["milestones_s"], "warm_milestones_s": warm["milestones_s"], **st},
            "notes": "both exports run `kiln export` end to end on the embedded Prefect API into the same store "
                     "and host cache; the warm one compiles nothing but still starts the API, probes, and "
                     "loads and checks every forward on every rank against eager (share + verify). "
                     "no_startup subtracts the embedded API start-up (median no-op flow without a server "
                     "minus with one) from both sides"}


def part_overhead(ctx: Context) -> dict:
    cold = cold_export(ctx)
    st = startup(ctx)
    w, s = ctx.work, ctx.s
    out = w.path("direct", "direct.json")
    run = w.run("direct-cold", [PYTHON, "-m", "bench.direct", "--model", ctx.model, "--tp", str(s.tp),
                                "--buckets", s.buckets, "--store", f"file://{w.path('direct', 'store')}",
                                "--json", str(out)],
                w.env(inductor="direct", kiln_home="direct/home")).expect(0)
    direct = json.loads(out.read_text())
    fixed = st["embedded_api_startup_s"]
    return {"figures": {"overhead_ratio": ratio(cold["wall_s"], run.wall_s),
                        "overhead_ratio_no_startup": ratio(less(cold["wall_s"], fixed), run.wall_s)},
            "raw": {"export_wall_s": cold["wall_s"], "direct_wall_s": run.wall_s, "direct": direct,
                    "export_phases_s": {p["name"]: p["duration_s"] for p in cold["report"]["phases"]},
                    "export_milestones_s": cold["milestones_s"],
                    "embedded_api_startup_s": fixed},
            "notes": "the plain script (bench/direct.py) runs the same phases through tasks.hostwork (same "
                     "CompilePool, same local store, same verify of every rank) in one process without Prefect; "
                     f"both sides cold. {COLD_NOTE}."}
