"""A mixture of experts' steps follow the experts chosen, and its prefill compile does not grow with them.

Compiles the 1x1 (decode) forward of bench.moe_step's model at 4 and at 32 experts and its prefill forward
(bucket bench.moe_step.PREFILL) at 4, 32 and 128 (top 2 of each, all else equal), each in a fresh process
and Inductor cache: the prefill compile at 128 experts over 4. Then times the decode steps side by side in
one process, alternating, and the prefill steps with their peak memory beyond the weights (bench.moe_step's
`step`), 32 experts over 4. Evaluating every expert would make either step about 8x; the prefill's memory
must not grow with the experts.
"""

from __future__ import annotations

import json

from bench.context import Context
from bench.figures import median, ratio
from bench.moe_step import COMPILE_EXPERTS, DTYPE, EXPERTS, PEAK_ENV, PREFILL, TOP_K, package_name
from bench.runs import PYTHON


def part_moe(ctx: Context) -> dict:
    w = ctx.work
    out = w.path("moe", "packages")
    out.mkdir(parents=True, exist_ok=True)
    prefill = "x".join(map(str, PREFILL))
    compile_s: dict[str, float] = {}
    for bucket, counts in (((1, 1), EXPERTS), (PREFILL, COMPILE_EXPERTS)):
        for experts in counts:
            name = package_name(experts, bucket)
            w.run(f"moe-compile-{name}",
                  [PYTHON, "-m", "bench.moe_step", "compile", str(experts), str(out), "x".join(map(str, bucket))],
                  w.env(inductor=f"moe/inductor-{name}", kiln_home="moe/home")).expect(0)
            compile_s[name] = json.loads((out / f"{name}.json").read_text())["compile_s"]
    reps, steps = (3, 20) if ctx.s.quick else (max(5, ctx.s.reps), 100)
    few, many = EXPERTS
    env = {**w.env(inductor="moe/inductor-step", kiln_home="moe/home"), **PEAK_ENV}
    results = {}
    for kind, bucket, n in (("step", (1, 1), steps), ("prefill", PREFILL, 1)):
        paths = [str(out / f"{package_name(e, bucket)}.pt2") for e in EXPERTS]
        w.run(f"moe-{kind}", [PYTHON, "-m", "bench.moe_step", "step", str(out / f"{kind}.json"), str(reps), str(n),
                              *paths], env).expect(0)
        got = json.loads((out / f"{kind}.json").read_text())
        results[kind] = {str(e): got[p] for e, p in zip(EXPERTS, paths)}
    step, pre = results["step"], results["prefill"]
    f, m = str(few), str(many)
    ratios = {"moe_step_ratio": [ratio(a, b) for a, b in zip(step[m]["s"], step[f]["s"])],
              "moe_prefill_step_ratio": [ratio(a, b) for a, b in zip(pre[m]["s"], pre[f]["s"])],
              "moe_prefill_peak_ratio": [ratio(a, b) for a, b in zip(pre[m]["peak_bytes"], pre[f]["peak_bytes"])]}
    figures = {name: median(values) for name, values in ratios.items()}
    most, least = max(COMPILE_EXPERTS), min(COMPILE_EXPERTS)
    figures["moe_prefill_compile_ratio"] = ratio(compile_s[package_name(most, PREFILL)],
                                                 compile_s[package_name(least, PREFILL)])
    return {"figures": figures, "samples": ratios,
            "raw": {"compile_s": compile_s, "step_s": {e: step[e]["s"] for e in (f, m)},
                    "steps_per_sample": steps, "prefill": pre},
            "notes": f"Qwen3-MoE layers at the tiny model's width in {DTYPE}, 2 layers, top {TOP_K}, one rank's shard "
                     f"of tp 2, bucket 1x1 and {prefill}; {many} experts over {few}, alternating, one thread; prefill "
                     f"compiled at {', '.join(map(str, COMPILE_EXPERTS))} experts, each in a fresh process and "
                     "Inductor cache, one after another; a step's peak is its growth of VmHWM over the resident "
                     "memory before it (weights excluded), with glibc's mmap threshold fixed at 64 KiB so each step's "
                     "activations are its own"}
