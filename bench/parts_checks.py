"""The check catches wrong forwards and passes right ones (issue 53): two fractions, each of its whole list.

`wrong_forwards_caught`: bench.wrong_forwards' fixed list of wrong forwards (every mixture-of-experts family,
float32 and bfloat16, at a one-token step and a range's checked shapes; eager forwards with one thing
changed) caught by the check, of all of them. `right_forward_draws_passed`: bench.check_draws' draws at a
real router width (Qwen3-30B-A3B's and DeepSeek-V3's, bfloat16, tp 2), each rank's compiled forward bound to
the draw's weights passing its check, of all draws. Target 1.0 each. `--quick` takes two shapes and two
draws of Qwen3-MoE alone, never fewer mutations.
"""

from __future__ import annotations

import json

from bench.check_draws import FAMILIES as DRAW_FAMILIES
from bench.context import Context
from bench.runs import PYTHON

DRAWS, QUICK_DRAWS = 10, 2


def part_checks(ctx: Context) -> dict:
    w, quick = ctx.work, ctx.s.quick
    env = w.env(inductor="checks/inductor", kiln_home="checks/home")
    wrong_out = w.path("checks", "wrong_forwards.json")
    w.run("checks-wrong-forwards", [PYTHON, "-m", "bench.wrong_forwards", str(wrong_out),
                                    *(["--quick"] if quick else [])], env).expect(0)
    wrong = json.loads(wrong_out.read_text())
    draws_out = w.path("checks", "draws.jsonl")
    families = ["qwen3-30b-a3b"] if quick else list(DRAW_FAMILIES)
    draws = QUICK_DRAWS if quick else DRAWS
    w.run("checks-draws", [PYTHON, "-m", "bench.check_draws", str(draws_out), *families, "--draws", str(draws)],
          env).expect(0)
    lines = [json.loads(line) for line in draws_out.read_text().splitlines()]
    passed = sum(line.get("passed", 0) for line in lines)
    figures = {"wrong_forwards_caught": wrong["caught"] / wrong["wrong"],
               "right_forward_draws_passed": passed / (draws * len(families))}
    return {"figures": figures, "samples": {name: [value] for name, value in figures.items()},
            "raw": {"wrong_forwards": {k: wrong[k] for k in ("caught", "wrong", "right_passed", "right", "missed",
                                                            "seconds")},
                    "draws": [{k: line.get(k) for k in ("family", "reduced", "export_exit", "export_s", "compile_s",
                                                         "passed", "of", "error", "draws")} for line in lines]},
            "notes": f"wrong forwards: {wrong['wrong']} (mutation, family, dtype, shape) checks of eager forwards with "
                     f"one thing changed, {wrong['right']} right ones; right forwards: {draws} draw(s) each of "
                     f"{', '.join(families)} at the published router width in bfloat16, tp 2, bucket 1x16, the "
                     "forward compiled once by `kiln export` of draw 0 and every draw's weights bound to it, both "
                     "ranks checked as the export checks a rank"}
