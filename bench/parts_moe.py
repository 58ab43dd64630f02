"""A mixture of experts' decode step follows the experts chosen, not all of them.

Compiles the 1x1 forward of bench.moe_step's model at 4 and at 32 experts (top 2 of each, all else equal),
each in a fresh process and Inductor cache, then times their decode steps side by side in one process,
alternating. Evaluating every expert would make the 32-expert step about 8x the 4-expert one.
"""

from __future__ import annotations

import json

from bench.context import Context
from bench.figures import median, ratio
from bench.moe_step import EXPERTS, TOP_K
from bench.runs import PYTHON


def part_moe(ctx: Context) -> dict:
    w = ctx.work
    out = w.path("moe", "packages")
    out.mkdir(parents=True, exist_ok=True)
    compile_s: dict[str, float] = {}
    for experts in EXPERTS:
        w.run(f"moe-compile-{experts}", [PYTHON, "-m", "bench.moe_step", "compile", str(experts), str(out)],
              w.env(inductor=f"moe/inductor-{experts}", kiln_home="moe/home")).expect(0)
        compile_s[str(experts)] = json.loads((out / f"experts-{experts}.json").read_text())["compile_s"]
    reps, steps = (3, 20) if ctx.s.quick else (max(5, ctx.s.reps), 100)
    few, many = (str(e) for e in EXPERTS)
    w.run("moe-step", [PYTHON, "-m", "bench.moe_step", "step", str(out), str(reps), str(steps), few, many],
          w.env(inductor="moe/inductor-step", kiln_home="moe/home")).expect(0)
    step = json.loads((out / "step.json").read_text())
    ratios = [ratio(m, f) for m, f in zip(step[many], step[few])]
    return {"figures": {"moe_step_ratio": median(ratios)}, "samples": {"moe_step_ratio": ratios},
            "raw": {"compile_s": compile_s, "step_s": step, "steps_per_sample": steps},
            "notes": f"Qwen3-MoE layers at the tiny model's width, 2 layers, top {TOP_K}, one rank's shard of tp 2, "
                     f"bucket 1x1; {many} experts over {few}, alternating, one thread"}
