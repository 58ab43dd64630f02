"""Compile time against depth: the decoder layers compiled once per bucket (a scan), not once per layer.

Each sample compiles the 1x1 forward at every depth of bench.depth_step.DEPTHS
(QUICK_DEPTHS with --quick; scanned, as Kiln does) and the deepest one unrolled, each in a fresh process
with a fresh Inductor cache, in the opposite order on every other sample. Then
the deepest scanned and unrolled packages time a decode step side by side.

With --quick, the scanned package at the tiny model's own depth is the one the collective part compiled
this run, when it ran: the same forward key (bench.collective_step's native package), compiled the same
way (the first compile of a fresh process with a fresh Inductor cache), so it is not compiled a second
time; its compile seconds are that compile's. A full run compiles every side itself.
"""

from __future__ import annotations

import json

import shutil

from bench.context import Context
from bench.depth_step import DEPTHS, QUICK_DEPTHS
from bench.figures import median, ratio
from bench.runs import PYTHON


def _collective_native(ctx: Context, layers: int, out) -> dict | None:
    """--quick: {'compile_s', 'size_bytes'} of the collective part's native package, copied to `out` as the
    scanned package at `layers`, when the collective part compiled it this run and it is that forward (same
    key); else None (compile it)."""
    from bench import collective_step, depth_step

    if not (ctx.s.quick and ctx.has("collective-packages")) or \
            depth_step._spec(layers)["key"] != collective_step._spec()["key"]:
        return None
    from bench.parts_collective import packages

    made = packages(ctx)
    native = made["dir"] / "native.pt2"
    shutil.copyfile(native, out / f"scan-{layers}.pt2")
    return {"compile_s": made["compiled"]["compile_s"]["native"], "size_bytes": native.stat().st_size}


def part_depth(ctx: Context) -> dict:
    w = ctx.work
    samples = 1 if ctx.s.quick else ctx.s.samples
    depths = QUICK_DEPTHS if ctx.s.quick else DEPTHS
    sides = [(layers, "scan") for layers in depths] + [(depths[-1], "unrolled")]
    compile_s: dict[str, list[float]] = {f"{layout}-{layers}": [] for layers, layout in sides}
    sizes: dict[str, int] = {}
    out = w.path("depth", "packages")
    out.mkdir(parents=True, exist_ok=True)
    reused: list[str] = []
    for sample in range(samples):
        for layers, layout in (sides if sample % 2 == 0 else sides[::-1]):
            name = f"{layout}-{layers}"
            result = _collective_native(ctx, layers, out) if layout == "scan" else None
            if result is not None:
                reused.append(name)
            else:
                w.run(f"depth-compile-{name}-s{sample + 1}",
                      [PYTHON, "-m", "bench.depth_step", "compile", str(layers), layout, str(out)],
                      w.env(inductor=f"depth/inductor-{name}-s{sample + 1}", kiln_home="depth/home")).expect(0)
                result = json.loads((out / f"{name}.json").read_text())
            compile_s[name].append(result["compile_s"])
            sizes[name] = result["size_bytes"]
    reps, steps = (3, 20) if ctx.s.quick else (5, 50)
    w.run("depth-step", [PYTHON, "-m", "bench.depth_step", "step", str(depths[-1]), str(out), str(reps), str(steps)],
          w.env(inductor="depth/inductor-step", kiln_home="depth/home")).expect(0)
    step = json.loads((out / "step.json").read_text())
    deepest, shallowest = f"scan-{depths[-1]}", f"scan-{depths[0]}"
    depth_ratios = [ratio(d, s) for d, s in zip(compile_s[deepest], compile_s[shallowest])]
    step_ratios = [ratio(s, u) for s, u in zip(step["scan"], step["unrolled"])]
    unrolled_ratios = [ratio(u, s) for u, s in zip(compile_s[f"unrolled-{depths[-1]}"], compile_s[shallowest])]
    return {"figures": {"compile_depth_ratio": median(depth_ratios), "scan_step_ratio": median(step_ratios),
                        "unrolled_depth_ratio": median(unrolled_ratios)},
            "samples": {"compile_depth_ratio": depth_ratios, "scan_step_ratio": step_ratios,
                        "unrolled_depth_ratio": unrolled_ratios},
            "raw": {"compile_s": compile_s, "median_compile_s": {k: median(v) for k, v in compile_s.items()},
                    "size_bytes": sizes, "step_s": {k: step[k] for k in ("scan", "unrolled")},
                    "step_max_abs_diff": step["max_abs_diff"], "steps_per_sample": steps,
                    "from_collective_part": reused},
            "notes": f"tiny model's width at {', '.join(map(str, depths))} layers, bucket 1x1, one rank's shard of "
                     "tp 2; each compile a fresh process and Inductor cache; the step compares the deepest model's "
                     "scanned and unrolled packages with the same weights, one thread, alternating"
                     + (f"; {', '.join(reused)}: the collective part's native package (the same forward, compiled "
                        "the same way), not compiled again" if reused else "")}
