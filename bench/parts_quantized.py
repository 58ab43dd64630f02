"""Quantized weights kept quantized against the same model in bfloat16 (issue 49's bench part `quantized`): FP8
blocks (Qwen3-30B-A3B's widths) and gpt-oss's MXFP4 experts (gpt-oss-20b's widths).

For each pair (bench.quantized_step.PAIRS) compiles the decode (1x1) and prefill (1x64) forwards of one rank (tp
2) in both formats, each in a fresh process and Inductor cache (the format compiled first alternating: a part's
first compile runs slower), and records the rank's weights as its loader holds them; then times each bucket's
two packages side by side in one process, alternating, one thread. Figures per pair (`quantized_*` for FP8
blocks, `mxfp4_*` for MXFP4): the rank's held weight bytes over its slices' bytes in the quantized checkpoint
and over the bfloat16 rank's, its decode and prefill step quantized over bfloat16, and the compile quantized
over bfloat16 (the median of the two buckets').
"""

from __future__ import annotations

import json

from bench.context import Context
from bench.figures import median, ratio
from bench.quantized_step import BUCKETS, EXPERTS, OSS_TOP_K, PAIRS, TOP_K, package_name
from bench.runs import PYTHON

PREFIX = {"fp8": "quantized", "mxfp4": "mxfp4"}
"""The figures' prefix of each quantized format."""


def part_quantized(ctx: Context) -> dict:
    w = ctx.work
    out = w.path("quantized", "packages")
    out.mkdir(parents=True, exist_ok=True)
    info, step_s, samples, figures = {}, {}, {}, {}
    reps, steps = (3, 5) if ctx.s.quick else (max(5, ctx.s.reps), 20)
    env = w.env(inductor="quantized/inductor-step", kiln_home="quantized/home")
    for pair in PAIRS:
        quantized, plain = pair
        prefix = PREFIX[quantized]
        for i, bucket in enumerate(BUCKETS):
            for fmt in (pair if i % 2 else pair[::-1]):  # which compiles first alternates over the buckets
                name = package_name(fmt, bucket)
                w.run(f"quantized-compile-{name}",
                      [PYTHON, "-m", "bench.quantized_step", "compile", fmt, str(out), "x".join(map(str, bucket))],
                      w.env(inductor=f"quantized/inductor-{name}", kiln_home="quantized/home")).expect(0)
                info[name] = json.loads((out / f"{name}.json").read_text())
        for (batch, tokens), kind in zip(BUCKETS, ("decode", "prefill")):
            paths = [str(out / f"{package_name(fmt, (batch, tokens))}.pt2") for fmt in pair]
            result = out / f"step-{quantized}-{batch}x{tokens}.json"
            w.run(f"quantized-step-{quantized}-{batch}x{tokens}",
                  [PYTHON, "-m", "bench.quantized_step", "step", str(result), str(reps),
                   str(steps if tokens == 1 else 2), *paths], env).expect(0)
            got = json.loads(result.read_text())
            held, twin = (got[p]["s"] for p in paths)
            step_s[f"{quantized}-{batch}x{tokens}"] = {quantized: held, plain: twin}
            samples[f"{prefix}_{kind}_step_ratio"] = [ratio(a, b) for a, b in zip(held, twin)]
            figures[f"{prefix}_{kind}_step_ratio"] = median(samples[f"{prefix}_{kind}_step_ratio"])
        decode = {fmt: info[package_name(fmt, BUCKETS[0])] for fmt in pair}
        figures[f"{prefix}_weight_bytes_ratio"] = ratio(decode[quantized]["held_bytes"],
                                                        decode[quantized]["checkpoint_slice_bytes"])
        figures[f"{prefix}_vs_bf16_bytes_ratio"] = ratio(decode[quantized]["held_bytes"], decode[plain]["held_bytes"])
        samples[f"{prefix}_compile_ratio"] = [ratio(info[package_name(quantized, b)]["compile_s"],
                                                    info[package_name(plain, b)]["compile_s"]) for b in BUCKETS]
        figures[f"{prefix}_compile_ratio"] = median(samples[f"{prefix}_compile_ratio"])
    return {"figures": figures, "samples": samples,
            "raw": {"packages": info, "step_s": step_s},
            "notes": f"FP8 blocks: Qwen3-30B-A3B's widths at 2 layers and {EXPERTS} experts (top {TOP_K}), blocks of "
                     "128 x 128 with float32 scales; MXFP4: gpt-oss-20b's widths at 2 layers, its 32 experts (top "
                     f"{OSS_TOP_K}), a vocabulary of 32000; each against the same model unquantized, bfloat16 "
                     "compute, one rank's shard of tp 2; held bytes are the rank's constants as Kiln's loader holds "
                     "them (planned: rank_bytes.weight_bytes_per_rank, in raw); compiles each in a fresh process and "
                     "Inductor cache; steps alternating in one process, one thread"}
