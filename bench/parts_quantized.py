"""FP8-block weights kept quantized against the same model in bfloat16 (issue 49's bench part `quantized`).

Compiles the decode (1x1) and prefill (1x64) forwards of one rank (tp 2) of bench.quantized_step's model in both
formats, each in a fresh process and Inductor cache (the format compiled first alternating: a part's first
compile runs slower), and records the rank's weights as its loader holds them; then times each bucket's two
packages side by side in one process, alternating, one thread. Figures: the rank's held weight bytes over
its slices' bytes in the FP8 checkpoint and over the bfloat16 rank's, its decode and prefill step FP8 over
bfloat16, and the compile FP8 over bfloat16 (the median of the two buckets').
"""

from __future__ import annotations

import json

from bench.context import Context
from bench.figures import median, ratio
from bench.quantized_step import BUCKETS, EXPERTS, FORMATS, TOP_K, package_name
from bench.runs import PYTHON


def part_quantized(ctx: Context) -> dict:
    w = ctx.work
    out = w.path("quantized", "packages")
    out.mkdir(parents=True, exist_ok=True)
    info = {}
    for i, bucket in enumerate(BUCKETS):
        for fmt in (FORMATS if i % 2 else FORMATS[::-1]):  # which compiles first alternates over the buckets
            name = package_name(fmt, bucket)
            w.run(f"quantized-compile-{name}",
                  [PYTHON, "-m", "bench.quantized_step", "compile", fmt, str(out), "x".join(map(str, bucket))],
                  w.env(inductor=f"quantized/inductor-{name}", kiln_home="quantized/home")).expect(0)
            info[name] = json.loads((out / f"{name}.json").read_text())
    reps, steps = (3, 5) if ctx.s.quick else (max(5, ctx.s.reps), 20)
    env = w.env(inductor="quantized/inductor-step", kiln_home="quantized/home")
    step_s, samples = {}, {}
    for (batch, tokens), figure in zip(BUCKETS, ("quantized_decode_step_ratio", "quantized_prefill_step_ratio")):
        paths = [str(out / f"{package_name(fmt, (batch, tokens))}.pt2") for fmt in FORMATS]
        result = out / f"step-{batch}x{tokens}.json"
        w.run(f"quantized-step-{batch}x{tokens}", [PYTHON, "-m", "bench.quantized_step", "step", str(result),
                                                    str(reps), str(steps if tokens == 1 else 2), *paths],
              env).expect(0)
        got = json.loads(result.read_text())
        fp8, bf16 = (got[p]["s"] for p in paths)
        step_s[f"{batch}x{tokens}"] = {"fp8": fp8, "bf16": bf16}
        samples[figure] = [ratio(a, b) for a, b in zip(fp8, bf16)]
    decode = {fmt: info[package_name(fmt, BUCKETS[0])] for fmt in FORMATS}
    figures = {name: median(values) for name, values in samples.items()}
    figures["quantized_weight_bytes_ratio"] = ratio(decode["fp8"]["held_bytes"], decode["fp8"]["checkpoint_slice_bytes"])
    figures["quantized_vs_bf16_bytes_ratio"] = ratio(decode["fp8"]["held_bytes"], decode["bf16"]["held_bytes"])
    samples["quantized_compile_ratio"] = [ratio(info[package_name("fp8", b)]["compile_s"],
                                                info[package_name("bf16", b)]["compile_s"]) for b in BUCKETS]
    figures["quantized_compile_ratio"] = median(samples["quantized_compile_ratio"])
    return {"figures": figures, "samples": samples,
            "raw": {"packages": info, "step_s": step_s},
            "notes": f"Qwen3-30B-A3B's widths at 2 layers and {EXPERTS} experts (top {TOP_K}), bfloat16 compute, one "
                     "rank's shard of tp 2; FP8 blocks of 128 x 128 with float32 scales against the same model "
                     "unquantized; held bytes are the rank's constants as Kiln's loader holds them (planned: "
                     "rank_bytes.weight_bytes_per_rank, in raw); compiles each in a fresh process and Inductor "
                     "cache; steps alternating in one process, one thread"}
