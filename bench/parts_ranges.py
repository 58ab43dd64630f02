"""One compile for many shapes: the incident's 38 buckets as ranges (kiln.core.forwards.shape_ranges) against one
package per bucket, and the step time of a range package against the static package at the same shape.

Each side compiles in a fresh process with a fresh Inductor cache, one forward after another (one compile
worker's work), in the opposite order on every other sample. The ranges side compiles what the default
shape policy makes of the list (three forwards: 1x1, 2-256x1@256x1, 1x128-512@1x512). A full run compiles
all 38 static packages; --quick compiles the four the step comparison needs (1x1, 8x1, 256x1, 1x128) and
takes 38 x their median as the per-bucket side (a prediction from measured compiles, said in the notes).
Then each measured shape's static package and the range package that holds it time a step side by side.
"""

from __future__ import annotations

import json

from bench.context import Context
from bench.figures import median, ratio
from bench.runs import PYTHON

STEP_SHAPES = {"8x1": "2-256x1@256x1", "256x1": "2-256x1@256x1", "1x128": "1x128-512@1x512"}
"""Shape -> the range forward that serves it: a decode batch off the hint, the largest decode batch (the
hint), one prefill length off the hint. 1x1 is a static forward on both sides (a range cannot hold batch 1)."""


def part_ranges(ctx: Context) -> dict:
    from bench.range_step import incident_buckets
    from kiln.core.forwards.shape_ranges import group_buckets, static_shape

    w = ctx.work
    buckets = incident_buckets()
    ranges = [str(r) for r in group_buckets(buckets, "ranges")]
    every = [str(static_shape(b)) for b in buckets]
    measured = every if not ctx.s.quick else ["1x1", *STEP_SHAPES]
    samples = 1 if ctx.s.quick else ctx.s.samples
    sides = {"ranges": ranges, "static": measured}
    out = w.path("ranges", "packages")
    out.mkdir(parents=True, exist_ok=True)
    compile_s: dict[str, list[float]] = {"ranges": [], "static": []}
    per_forward: dict[str, dict] = {}
    for sample in range(samples):
        for side in (("ranges", "static") if sample % 2 == 0 else ("static", "ranges")):
            w.run(f"ranges-compile-{side}-s{sample + 1}",
                  [PYTHON, "-m", "bench.range_step", "compile", str(out), side, *sides[side]],
                  w.env(inductor=f"ranges/inductor-{side}-s{sample + 1}", kiln_home="ranges/home")).expect(0)
            done = json.loads((out / f"{side}.json").read_text())
            per_forward.update(done)
            total = sum(d["compile_s"] for d in done.values())
            if side == "static" and len(done) < len(every):  # --quick: the per-bucket side from its median
                total = median([d["compile_s"] for d in done.values()]) * len(every)
            compile_s[side].append(total)
    reps, steps = (5, 10) if ctx.s.quick else (15, 20)
    w.run("ranges-step", [PYTHON, "-m", "bench.range_step", "step", str(out), str(reps), str(steps),
                          *[f"{s}={s},{r}" for s, r in STEP_SHAPES.items()]],
          w.env(inductor="ranges/inductor-step", kiln_home="ranges/home")).expect(0)
    step = json.loads((out / "step.json").read_text())
    compile_ratios = [ratio(r, s) for r, s in zip(compile_s["ranges"], compile_s["static"])]
    step_ratios = {shape: median([ratio(r, s) for r, s in zip(v["range"], v["static"])]) for shape, v in step.items()}
    return {"figures": {"ranges_compile_ratio": median(compile_ratios), "ranges_forwards": float(len(ranges)),
                        "ranges_step_ratio": max(x for x in step_ratios.values() if x is not None)},
            "samples": {"ranges_compile_ratio": compile_ratios},
            "raw": {"buckets": len(every), "forwards": ranges, "compile_s": compile_s, "per_forward_s": per_forward,
                    "step_ratio_by_shape": step_ratios, "step_s": step,
                    "static_side": "measured" if measured == every else f"38 x median of {measured}"},
            "notes": f"tiny model, one rank's shard of tp 2; {len(every)} buckets (decode 1, 2, 4, 8..256 step 8; "
                     f"prefill 1x128, 1x256, 1x512) as {len(ranges)} forwards ({', '.join(ranges)}) against one "
                     "static package per bucket, each side one process compiling one forward after another with "
                     "a fresh Inductor cache"
                     + (f"; --quick: the per-bucket side is 38 x the median of {len(measured)} measured compiles"
                        if measured != every else "")
                     + f"; step: range package / static package at {', '.join(STEP_SHAPES)} (median of {reps} "
                       f"alternating samples of {steps} steps, one thread), the figure the worst of them"}
