"""Latent attention's decode step reads the cached latents as they are, instead of projecting every one up.

Compiles the 1x1 forward of bench.mla_step's model twice, each in a fresh process and Inductor cache: with its
latent attention absorbed (as Kiln picks for a decode step at a long context) and expanded (transformers'
order, forced), then times their decode steps over the same full context side by side, alternating.
"""

from __future__ import annotations

import json

from bench.context import Context
from bench.figures import median, ratio
from bench.mla_step import CONTEXT_TOKENS, ORDERS
from bench.runs import PYTHON


def part_mla(ctx: Context) -> dict:
    w = ctx.work
    out = w.path("mla", "packages")
    out.mkdir(parents=True, exist_ok=True)
    compile_s: dict[str, float] = {}
    for order in ORDERS:
        w.run(f"mla-compile-{order}", [PYTHON, "-m", "bench.mla_step", "compile", order, str(out)],
              w.env(inductor=f"mla/inductor-{order}", kiln_home="mla/home")).expect(0)
        compile_s[order] = json.loads((out / f"{order}.json").read_text())["compile_s"]
    reps, steps = (3, 5) if ctx.s.quick else (max(5, ctx.s.reps), 20)
    w.run("mla-step", [PYTHON, "-m", "bench.mla_step", "step", str(out), str(reps), str(steps)],
          w.env(inductor="mla/inductor-step", kiln_home="mla/home")).expect(0)
    step = json.loads((out / "step.json").read_text())
    ratios = [ratio(a, e) for a, e in zip(step["absorbed"], step["expanded"])]
    return {"figures": {"mla_step_ratio": median(ratios)}, "samples": {"mla_step_ratio": ratios},
            "raw": {"compile_s": compile_s, "step_s": {k: step[k] for k in ORDERS},
                    "max_abs_diff": step["max_abs_diff"], "steps_per_sample": steps},
            "notes": f"2 layers of latent attention (16 heads of 128 + 64, values of 128, latent 512), one rank's "
                     f"shard of tp 2, bucket 1x1 over {CONTEXT_TOKENS} cached tokens; absorbed over expanded, alternating, "
                     "one thread"}
