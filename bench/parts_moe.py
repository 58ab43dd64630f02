"""A mixture of experts' decode step follows the experts chosen, not all of them.

Compiles the 1x1 forward of bench.moe_step's model at 4 and at 32 experts (top 2 of each, all else equal),
each in a fresh process and Inductor cache, then times their decode steps side by side in one process,
alternating. Evaluating every expert would make the 32-expert step about 8x the 4-expert one.

Then the same for prefill (bucket bench.moe_step.PREFILL, where every expert runs over every token): the
step's time, and its peak memory beyond the weights (bench.moe_step's `prefill`), 32 experts over 4: the
time grows with the experts by design, the memory must not.
"""

from __future__ import annotations

import json

from bench.context import Context
from bench.figures import median, ratio
from bench.moe_step import EXPERTS, PEAK_ENV, PREFILL, TOP_K
from bench.runs import PYTHON


def part_moe(ctx: Context) -> dict:
    w = ctx.work
    out = w.path("moe", "packages")
    out.mkdir(parents=True, exist_ok=True)
    prefill = "x".join(map(str, PREFILL))
    compile_s: dict[str, float] = {}
    for bucket in ("1x1", prefill):
        for experts in EXPERTS:
            w.run(f"moe-compile-{experts}-{bucket}",
                  [PYTHON, "-m", "bench.moe_step", "compile", str(experts), str(out), bucket],
                  w.env(inductor=f"moe/inductor-{experts}-{bucket}", kiln_home="moe/home")).expect(0)
            name = f"experts-{experts}" + ("" if bucket == "1x1" else f"-{bucket}")
            compile_s[f"{experts}-{bucket}"] = json.loads((out / f"{name}.json").read_text())["compile_s"]
    reps, steps = (3, 20) if ctx.s.quick else (max(5, ctx.s.reps), 100)
    few, many = (str(e) for e in EXPERTS)
    w.run("moe-step", [PYTHON, "-m", "bench.moe_step", "step", str(out), str(reps), str(steps), few, many],
          w.env(inductor="moe/inductor-step", kiln_home="moe/home")).expect(0)
    step = json.loads((out / "step.json").read_text())
    w.run("moe-prefill", [PYTHON, "-m", "bench.moe_step", "prefill", str(out), str(reps), few, many],
          {**w.env(inductor="moe/inductor-step", kiln_home="moe/home"), **PEAK_ENV}).expect(0)
    pre = json.loads((out / "prefill.json").read_text())
    ratios = {"moe_step_ratio": [ratio(m, f) for m, f in zip(step[many]["s"], step[few]["s"])],
              "moe_prefill_step_ratio": [ratio(m, f) for m, f in zip(pre[many]["s"], pre[few]["s"])],
              "moe_prefill_peak_ratio": [ratio(m, f) for m, f in zip(pre[many]["peak_bytes"], pre[few]["peak_bytes"])]}
    return {"figures": {name: median(values) for name, values in ratios.items()}, "samples": ratios,
            "raw": {"compile_s": compile_s, "step_s": {e: step[e]["s"] for e in (few, many)},
                    "steps_per_sample": steps, "prefill": pre},
            "notes": f"Qwen3-MoE layers at the tiny model's width, 2 layers, top {TOP_K}, one rank's shard of tp 2, "
                     f"bucket 1x1 and {prefill}; {many} experts over {few}, alternating, one thread; a prefill step's "
                     "peak is its growth of VmHWM over the resident memory before it (weights excluded), "
                     "with glibc's mmap threshold fixed at 64 KiB so each step's activations are its own"}
