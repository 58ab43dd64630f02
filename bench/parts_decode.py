"""A decode step at a long context: 1024 cached tokens against 64.

Compiles the tiny model's 1x1 forward with 4 and with 64 pages of 16 tokens per sequence (bench.decode_context),
each in a fresh process and Inductor cache, then times their decode steps side by side in one process,
alternating, each at its full context.
"""

from __future__ import annotations

import json

from bench.context import Context
from bench.decode_context import PAGE_TOKENS, PAGES
from bench.figures import median, ratio
from bench.runs import PYTHON


def part_decode_context(ctx: Context) -> dict:
    w = ctx.work
    out = w.path("decode_context", "packages")
    out.mkdir(parents=True, exist_ok=True)
    compile_s = {}
    for pages in PAGES:
        w.run(f"decode-context-compile-{pages}", [PYTHON, "-m", "bench.decode_context", "compile", str(pages), str(out)],
              w.env(inductor=f"decode_context/inductor-{pages}", kiln_home="decode_context/home")).expect(0)
        compile_s[str(pages)] = json.loads((out / f"pages-{pages}.json").read_text())["compile_s"]
    reps, steps = (3, 20) if ctx.s.quick else (max(5, ctx.s.reps), 100)
    short, long = (str(p) for p in PAGES)
    w.run("decode-context-step", [PYTHON, "-m", "bench.decode_context", "step", str(out), str(reps), str(steps), short,
                                  long], w.env(inductor="decode_context/inductor-step", kiln_home="decode_context/home")
          ).expect(0)
    step = json.loads((out / "step.json").read_text())
    ratios = [ratio(lg, sh) for lg, sh in zip(step[long], step[short])]
    return {"figures": {"decode_context_ratio": median(ratios)}, "samples": {"decode_context_ratio": ratios},
            "raw": {"compile_s": compile_s, "step_s": step, "steps_per_sample": steps},
            "notes": f"the tiny model (2 layers), one rank's shard of tp 2, bucket 1x1, {int(long) * PAGE_TOKENS} "
                     f"cached tokens over {int(short) * PAGE_TOKENS}, every cached position valid, alternating, "
                     "one thread"}
