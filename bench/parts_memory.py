"""A rank's memory with several packages loaded, and what the check's sizing predicts for it.

Compiles bench.rank_peak's forward once (a fresh process and Inductor cache), then measures, each sample in
a fresh process, a rank that reads its weights, loads bench.rank_peak.PACKAGES packages with them, steps each
and then checks each against eager, as `kiln run` and the export's rank check do.
"""

from __future__ import annotations

import json

from bench.context import Context
from bench.figures import median, ratio
from bench.rank_peak import PACKAGES
from bench.runs import PYTHON
from kiln.core.plan.sizing import FORWARD_FIXED_MIB


def part_rank_peak(ctx: Context) -> dict:
    w = ctx.work
    out = w.path("rank_peak", "packages")
    out.mkdir(parents=True, exist_ok=True)
    mode = ["quick"] if ctx.s.quick else []
    w.run("rank-peak-compile", [PYTHON, "-m", "bench.rank_peak", "compile", str(out), *mode],
          w.env(inductor="rank_peak/inductor", kiln_home="rank_peak/home")).expect(0)
    rows = []
    for sample in range(ctx.s.samples):
        run = w.run(f"rank-peak-measure-s{sample + 1}",
                    [PYTHON, "-m", "bench.rank_peak", "measure", str(out), str(PACKAGES), *mode],
                    w.env(inductor="rank_peak/inductor", kiln_home="rank_peak/home"))
        run.expect(0)
        rows.append(json.loads(run.log.read_text().strip().splitlines()[-1]))
    fixed_bytes = PACKAGES * FORWARD_FIXED_MIB * 2**20  # the runtime's fixed cost, as the sizing counts it
    samples = {
        "rank_peak_ratio": [ratio(r["run_peak_bytes"] - fixed_bytes, r["weight_bytes"]) for r in rows],
        "rank_check_predicted_ratio": [ratio(r["predicted_check_mib"] * 2**20, r["check_peak_bytes"] + r["base_bytes"])
                                       for r in rows]}
    return {"figures": {name: median(values) for name, values in samples.items()}, "samples": samples,
            "raw": {"reps": rows, "packages": PACKAGES, "fixed_bytes": fixed_bytes,
                    "run_peak_over_weights": [ratio(r["run_peak_bytes"], r["weight_bytes"]) for r in rows],
                    "compile": json.loads((out / "compile.json").read_text())},
            "notes": f"one rank (tp 1) of a Llama of hidden 768 in float32, {PACKAGES} packages of its 1x8 forward "
                     "(one file loaded that many times), each process's VmHWM growth over its resident memory before "
                     "the weights were read, less the runtime's fixed cost as the sizing counts it "
                     f"({PACKAGES} x FORWARD_FIXED_MIB; raw.run_peak_over_weights keeps it in)"}
