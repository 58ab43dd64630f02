"""Ranks of unequal shares at tp 3 (issue 50's bench part `uneven`).

For Llama-3.1-8B's widths and DeepSeek-V4-Flash's proportions (bench.uneven_step.config), tp 3 splits the heads
unevenly (KV heads 3, 3, 2; output groups 3, 3, 2): two rank shapes, a package each, each compiled in a fresh
process and Inductor cache. Then every rank's decode step (1x1) with its own constants, alternating in one
process on one thread. Figures: the slowest rank's median step over the mean of the ranks' medians, per
model; and, as a count, the forwards tp 3 compiles per bucket (an even tp compiles one).
"""

from __future__ import annotations

import json

from bench.context import Context
from bench.figures import median, ratio
from bench.runs import PYTHON
from bench.uneven_step import MODELS, package_name


def part_uneven(ctx: Context) -> dict:
    from kiln.core.model.shares import graph_shares

    from bench.uneven_step import TP, config

    w = ctx.work
    out = w.path("uneven", "packages")
    out.mkdir(parents=True, exist_ok=True)
    reps, steps = (3, 5) if ctx.s.quick else (max(5, ctx.s.reps), 20)
    figures, samples, raw = {}, {}, {}
    for model in MODELS:
        shapes = graph_shares(config(model), TP)
        compiled = []
        for index in range(len(shapes)):
            name = package_name(model, index)
            w.run(f"uneven-compile-{name}", [PYTHON, "-m", "bench.uneven_step", "compile", model, str(out), str(index)],
                  w.env(inductor=f"uneven/inductor-{name}", kiln_home="uneven/home")).expect(0)
            compiled.append(json.loads((out / f"{name}.json").read_text()))
        result = out / f"step-{model}.json"
        w.run(f"uneven-step-{model}", [PYTHON, "-m", "bench.uneven_step", "step", model, str(out), str(result),
                                       str(reps), str(steps)],
              w.env(inductor="uneven/inductor-step", kiln_home="uneven/home")).expect(0)
        step_s = json.loads(result.read_text())
        ranks = sorted(step_s, key=int)
        # Per round: the slowest rank's sample over the mean of the ranks' samples of that round.
        rounds = list(zip(*(step_s[r]["s"] for r in ranks)))
        samples[f"uneven_{model}_step_balance"] = [ratio(max(row), sum(row) / len(row)) for row in rounds]
        medians = {r: median(step_s[r]["s"]) for r in ranks}
        figures[f"uneven_{model}_step_balance"] = ratio(max(medians.values()), sum(medians.values()) / len(medians))
        figures[f"uneven_{model}_forwards"] = len(shapes)
        raw[model] = {"packages": compiled, "step_s": step_s, "median_s": medians}
    return {"figures": figures, "samples": samples, "raw": raw,
            "notes": "tp 3, decode (1x1), bfloat16; llama: Llama-3.1-8B widths at 2 layers (vocabulary 8192); v4: "
                     "DeepSeek-V4-Flash proportions at a quarter width (8 output groups), 2 layers; one package per "
                     "distinct rank shape, each compiled in a fresh process and Inductor cache; every rank's step "
                     "with its own constants, alternating in one process, one thread, its all-reduce over a group "
                     "of one (a rank's own work)"}
