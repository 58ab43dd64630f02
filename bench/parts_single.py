"""Parts measured on one host: compile efficiency, pool vs loop, dedup, warm vs cold, overhead.

Per sample they share one cold `kiln export` (embedded Prefect API, local
store, fresh Inductor cache, the suite's buckets at tp 2), its warm re-export,
the plain loop and the plain script (`single_round`); the embedded API's
start-up (a no-op flow with and without a running server) is measured once
per suite run.
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
                       "--shape-policy", "static",  # one forward per bucket: the parts compare compile pools
                       "--store", f"file://{w.path('single', 'store')}", "--report", str(report),
                       "--export-id", f"bench-{name}"],
                w.env(inductor=inductor, kiln_home="single/home")).expect(0)
    milestones = run.milestones({"flow_run_began_s": r"Beginning flow run",
                                 "flow_run_finished_s": r"Flow run '.*Finished in state"})
    return {"wall_s": run.wall_s, "report": json.loads(report.read_text()), "milestones_s": milestones}


def _loop(ctx: Context) -> dict:
    w, s = ctx.work, ctx.s
    out = w.path("loop", "loop.json")
    run = w.run("loop-cold", [PYTHON, "-m", "bench.loop", "--model", ctx.model, "--tp", str(s.tp),
                              "--buckets", s.buckets, "--out", str(w.path("loop", "out")), "--json", str(out)],
                w.env(inductor="loop", kiln_home="loop/home")).expect(0)
    return {"wall_s": run.wall_s, **json.loads(out.read_text())}


def _direct(ctx: Context) -> dict:
    w, s = ctx.work, ctx.s
    out = w.path("direct", "direct.json")
    run = w.run("direct-cold", [PYTHON, "-m", "bench.direct", "--model", ctx.model, "--tp", str(s.tp),
                                "--buckets", s.buckets, "--store", f"file://{w.path('direct', 'store')}",
                                "--json", str(out)],
                w.env(inductor="direct", kiln_home="direct/home")).expect(0)
    return {"wall_s": run.wall_s, **json.loads(out.read_text())}


def single_round(ctx: Context) -> dict:
    """This sample's single-host sides, made once per sample: the cold export (then, into the same store,
    the warm one), the plain loop and the plain script, each only where a selected part reads it. Their
    order alternates between samples (the export first, then last), so no side always runs on a fresher
    machine; the warm export always follows its cold one, whose store it reuses."""
    def make() -> dict:
        ctx.warm_up()
        sel = ctx.selected
        sides = ["export"]
        if not sel or sel & {"compile_efficiency", "pool_vs_loop"}:
            sides.append("loop")
        if not sel or "overhead" in sel:
            sides.append("direct")
        out: dict = {"order": ctx.ordered(sides)}
        for side in out["order"]:
            if side == "export":
                out["cold"] = _export(ctx, "export-cold", inductor="export")
                if not sel or "warm_cold" in sel:
                    out["warm"] = _export(ctx, "export-warm", inductor="export")
            elif side == "loop":
                out["loop"] = _loop(ctx)
            else:
                out["direct"] = _direct(ctx)
        return out
    return ctx.once("single", make)


def cold_export(ctx: Context) -> dict:
    """This sample's cold single-host export."""
    return single_round(ctx)["cold"]


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
    """Median per-forward compile seconds of this sample's cold export, or the default when it did not run."""
    if ctx.has("single"):
        values = [f["compile_s"] for f in cold_export(ctx)["report"]["forwards"] if f["compile_s"]]
        if values:
            return median(values), "median per-forward compile_s of this run's cold export"
    return DEFAULT_COMPILE_S, "default (this run made no cold export)"


def loop_run(ctx: Context) -> dict:
    """This sample's plain compile loop; fails the part when it did not compile exactly the cold export's
    forward keys (then the two sides compare different work)."""
    r = single_round(ctx)
    exported = sorted(f["key"] for f in r["cold"]["report"]["forwards"])
    if r["loop"]["keys"] != exported:
        raise BenchFailed(f"the loop compiled other forwards than the export: {r['loop']['keys']} vs {exported}")
    return r["loop"]


def part_compile_efficiency(ctx: Context) -> dict:
    cold, loop = cold_export(ctx), loop_run(ctx)
    r = cold["report"]
    workers = sum(h["workers"] for h in r["hosts"])
    e = efficiency(list(loop["per_forward_compile_s"].values()), workers, _phase(r, "compile"))
    in_pool = [f["compile_s"] for f in r["forwards"] if f["compile_s"] is not None]
    in_loop = list(loop["per_forward_compile_s"].values())
    # What a fresh process pays on its first compile: the loop's first forward (its smallest bucket) against
    # the median of the loop's others. Every pool worker is such a fresh process.
    penalty = less(in_loop[0], median(in_loop[1:])) if len(in_loop) > 1 else None
    return {"figures": {"compile_efficiency": e["efficiency"]},
            "raw": {**e, "workers_used": workers, "loop_per_forward_compile_s": loop["per_forward_compile_s"],
                    "pool_per_forward_compile_s": in_pool, "num_forwards": len(in_pool),
                    "first_compile_penalty_s": penalty},
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
                     "same graphs (the same keys, enforced) with kiln.host.compile.compiler.compile_forward one after another "
                     f"in one process and does nothing else. {COLD_NOTE}."}


def part_dedup(ctx: Context) -> dict:
    r = cold_export(ctx)["report"]
    buckets = len({f["shapes"] for f in r["forwards"]})
    return {"figures": {"dedup_ratio": ratio(r["counts"]["compiled"], r["tp"] * buckets)},
            "raw": {"compiled": r["counts"]["compiled"], "tp": r["tp"], "buckets": buckets},
            "notes": "counts from the cold export's report: one artifact per bucket serves every rank"}


def part_warm_cold(ctx: Context) -> dict:
    cold = cold_export(ctx)
    st = startup(ctx)
    warm = single_round(ctx)["warm"]
    fixed = st["embedded_api_startup_s"]
    phases = {p["name"]: p["duration_s"] for p in warm["report"]["phases"]}
    return {"figures": {"warm_cold_ratio": ratio(warm["wall_s"], cold["wall_s"]),
                        "warm_cold_ratio_no_startup": ratio(less(warm["wall_s"], fixed), less(cold["wall_s"], fixed))},
            "raw": {"cold_wall_s": cold["wall_s"], "warm_wall_s": warm["wall_s"], "embedded_api_startup_s": fixed,
                    "warm_phases_s": phases, "warm_counts": warm["report"]["counts"],
                    "cold_milestones_s": cold["milestones_s"], "warm_milestones_s": warm["milestones_s"], **st},
            "notes": "both exports run `kiln export` end to end on the embedded Prefect API into the same store "
                     "and host cache; the warm one compiles nothing and checks nothing again (every forward was "
                     "verified on this host by the cold one, and remembered), but still starts Python, torch and "
                     "the API, probes, plans, writes the manifest, the ledger picture and the artifacts. "
                     "no_startup subtracts the embedded API start-up (median no-op flow without a server "
                     "minus with one) from both sides"}


def part_overhead(ctx: Context) -> dict:
    cold = cold_export(ctx)
    st = startup(ctx)
    direct = single_round(ctx)["direct"]
    fixed = st["embedded_api_startup_s"]
    return {"figures": {"overhead_ratio": ratio(cold["wall_s"], direct["wall_s"]),
                        "overhead_ratio_no_startup": ratio(less(cold["wall_s"], fixed), direct["wall_s"])},
            "raw": {"export_wall_s": cold["wall_s"], "direct_wall_s": direct["wall_s"], "direct": direct,
                    "export_phases_s": {p["name"]: p["duration_s"] for p in cold["report"]["phases"]},
                    "export_milestones_s": cold["milestones_s"],
                    "embedded_api_startup_s": fixed},
            "notes": "the plain script (bench/direct.py) runs the same phases through kiln.host (same "
                     "CompilePool, same local store, same verify of every rank) in one process without Prefect; "
                     f"both sides cold. {COLD_NOTE}."}
