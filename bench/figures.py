"""The suite's figures: names, targets, ratio arithmetic and the markdown table. Pure.

Every figure is a ratio of two things measured side by side in the same run
(or, labelled as such, a count, a prediction or a synthetic timing), the
median of its samples. No torch, prefect or boto3
import: this module is unit-tested on plain numbers.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class Target:
    """A figure's target: `value OP bound`, e.g. fail_fast_ratio <= 0.1."""

    op: str
    """One of '<=', '<', '>=', '=='."""
    bound: float

    def met(self, value: float | None) -> bool | None:
        """True or False; None when there is no finite value to judge."""
        if value is None or not math.isfinite(value):
            return None
        if self.op == "<=":
            return value <= self.bound
        if self.op == "<":
            return value < self.bound
        if self.op == ">=":
            return value >= self.bound
        if self.op == "==":
            return math.isclose(value, self.bound, rel_tol=1e-9, abs_tol=1e-12)
        raise ValueError(f"unknown target operator {self.op!r}")

    def __str__(self) -> str:
        return f"{self.op} {self.bound:g}"


# name -> (part, what the figure compares); the order is the table's order.
FIGURES: dict[str, tuple[str, str]] = {
    "fail_fast_ratio": ("fail_fast", "refused export, start to exit / compile-first baseline, start to failed check"),
    "fail_fast_ratio_no_startup": ("fail_fast", "refused run, probe start to refusal / baseline, probe start to failed "
                                                "check (both unbroken wall time measured in-process)"),
    "compile_efficiency": ("compile_efficiency", "ideal pool wall from the loop's per-forward seconds (their sum / "
                                                 "workers used) / the cold export's compile-phase wall"),
    "pool_vs_loop_ratio": ("pool_vs_loop", "cold `kiln export` wall / plain one-process compile loop wall"),
    "pool_vs_loop_compile_ratio": ("pool_vs_loop", "cold export's compile phase / the loop's compile time"),
    "dedup_ratio": ("dedup", "a count, not a timing: forwards compiled / (tp x buckets), from the cold report"),
    "warm_cold_ratio": ("warm_cold", "warm re-export wall / cold export wall (embedded API both)"),
    "warm_cold_ratio_no_startup": ("warm_cold", "the same, less the embedded API start-up on both sides"),
    "overhead_ratio": ("overhead", "cold `kiln export` (embedded API) / plain script, same pool and store"),
    "overhead_ratio_no_startup": ("overhead", "the same, less the embedded API start-up"),
    "store_upload_ratio": ("store", "Kiln S3Store.put_file MiB/s / boto3 upload_file MiB/s (median of pairs)"),
    "store_download_ratio": ("store", "Kiln S3Store.get_file MiB/s / boto3 download_file MiB/s (median of pairs)"),
    "borrow_ratio": ("borrow", "compile phase: one host compiles for all / all three compile"),
    "borrow_export_ratio": ("borrow", "whole export: one host compiles for all / all three compile"),
    "borrow_predicted_vs_measured": ("borrow", "a prediction checked: gate's predicted compile s / measured compile "
                                               "phase (lending run)"),
    "python_free_step_ratio": ("collective", "decode step at tp 2: Python-free package / Python custom-op package "
                                             "(median s per step, alternating samples)"),
    "compile_depth_ratio": ("depth", "per-bucket compile s at 24 layers / at 2 layers, the layers one scan "
                                     "(fresh Inductor cache per side, alternating)"),
    "unrolled_depth_ratio": ("depth", "the same at 24 layers unrolled / 2 layers scanned: what the scan saves"),
    "scan_step_ratio": ("depth", "decode step at 24 layers: scanned package / unrolled package (median s per step, "
                                 "alternating samples)"),
    "moe_step_ratio": ("moe", "decode step of a mixture of experts, top 2 of 32 experts / top 2 of 4 (median s per "
                              "step, alternating): every expert evaluated would give ~8"),
    "moe_prefill_peak_ratio": ("moe", "prefill step (4x32) of a mixture of experts, top 2 of 32 experts / top 2 of "
                                      "4: peak memory beyond the weights (median): all experts' activations at once "
                                      "would grow with the experts"),
    "moe_prefill_step_ratio": ("moe", "the same prefill step's time, 32 experts / 4 (median, alternating): each "
                                      "expert runs over its own tokens only, but 256 pairs reach every expert, so "
                                      "the step reads 8x the weights; every expert over every token gave ~5"),
    "moe_prefill_compile_ratio": ("moe", "prefill forward (4x32) compile s, top 2 of 128 experts / top 2 of 4 (each in "
                                         "a fresh process and Inductor cache): one grouped multiply whatever the "
                                         "experts; one expert's code per expert would grow with them"),
    "mla_step_ratio": ("mla", "decode step of latent attention over 1024 cached tokens: the latents read as they are "
                              "(absorbed) / projected up to every head's keys and values first (expanded, "
                              "transformers' order) (median s per step, alternating)"),
    "decode_context_ratio": ("decode_context", "decode step over 1024 cached tokens / over 64 (the tiny model, median "
                                               "s per step, alternating): the pages read where they lie"),
    "s3_rank_bytes_ratio": ("s3_read", "S3 checkpoint at tp 2: most weight bytes one rank read by ranged GETs / "
                                       "that rank's weight bytes (default: a column-cut tensor in one GET)"),
    "s3_read_vs_download_ratio": ("s3_read", "one rank's read of an S3 checkpoint (list, headers, its slices) / "
                                             "boto3 downloading every file whole (median)"),
    "s3_exact_rank_bytes_ratio": ("s3_read", "the same bytes ratio with merge_gap_bytes 0: one GET per row of a "
                                             "column-cut tensor"),
    "s3_exact_read_vs_download_ratio": ("s3_read", "the same time ratio with merge_gap_bytes 0"),
    "rank_peak_ratio": ("rank_peak", "one rank with 6 packages loaded and stepped: peak resident memory above the "
                                     "bare process, less the runtime's fixed cost (6 x FORWARD_FIXED_MIB) / the "
                                     "rank's weight bytes"),
    "rank_check_predicted_ratio": ("rank_peak", "a prediction checked: check_peak_mib for that rank's check "
                                                "(6 forwards against eager) / its measured peak"),
    "s3_loader_peak_ratio": ("s3_read", "peak memory of one rank's load from S3 (fresh process, rank 0 of tp 2 of "
                                        "a ~300 MB checkpoint) / that rank's weight bytes"),
    "local_loader_peak_ratio": ("s3_read", "the same from the same files in a local directory"),
    "ranges_compile_ratio": ("ranges", "compile s of the incident's 38 buckets as the default shape policy's ranges / "
                                       "as one static package per bucket (fresh Inductor cache per side, "
                                       "alternating; --quick predicts the per-bucket side from 4 compiles)"),
    "ranges_forwards": ("ranges", "a count, not a timing: forwards the default shape policy makes of those 38 "
                                  "buckets"),
    "ranges_step_ratio": ("ranges", "step s: range package / static package at the same shape, the worst of 8x1, "
                                    "256x1 and 1x128 (median of alternating samples)"),
    "quantized_weight_bytes_ratio": ("quantized", "a rank's weights as its loader holds them / its slices' bytes "
                                     "in the FP8-block checkpoint (Qwen3-30B-A3B widths, 2 layers, tp 2)"),
    "quantized_vs_bf16_bytes_ratio": ("quantized", "a rank's held weights, FP8-block checkpoint / the same model in "
                                      "bfloat16 (bytes; at 2 layers the bfloat16 embedding and head weigh most)"),
    "quantized_decode_step_ratio": ("quantized", "decode step (1x1), FP8-block weights dequantized in the graph / "
                                    "bfloat16 weights (median s per step, alternating, one thread)"),
    "quantized_prefill_step_ratio": ("quantized", "prefill step (1x64), FP8-block weights / bfloat16 weights (median "
                                     "s per step, alternating, one thread)"),
    "quantized_compile_ratio": ("quantized", "compile s, FP8-block weights / bfloat16 weights, the median of the "
                                "decode and prefill forwards' (each in a fresh process and Inductor cache, the "
                                "format compiled first alternating)"),
    "mxfp4_weight_bytes_ratio": ("quantized", "a rank's weights as its loader holds them / its slices' bytes in "
                                 "gpt-oss's MXFP4 checkpoint (gpt-oss-20b widths, 2 layers, its 32 experts, tp 2)"),
    "mxfp4_vs_bf16_bytes_ratio": ("quantized", "a rank's held weights, MXFP4 checkpoint / the same model in bfloat16 "
                                  "(bytes)"),
    "mxfp4_decode_step_ratio": ("quantized", "decode step (1x1), MXFP4 experts dequantized in the graph / bfloat16 "
                                "experts (median s per step, alternating, one thread)"),
    "mxfp4_prefill_step_ratio": ("quantized", "prefill step (1x64), MXFP4 experts / bfloat16 experts (median s per "
                                 "step, alternating, one thread)"),
    "mxfp4_compile_ratio": ("quantized", "compile s, MXFP4 experts / bfloat16 experts, the median of the decode and "
                            "prefill forwards'"),
    "uneven_llama_step_balance": ("uneven", "decode step (1x1) at tp 3 of Llama-3.1-8B's widths (KV heads 3, 3, "
                                            "2): the slowest rank's median s / the mean of the ranks' medians"),
    "uneven_llama_forwards": ("uneven", "a count, not a timing: forwards tp 3 compiles per bucket of that model (an "
                                        "even tp: 1)"),
    "uneven_v4_step_balance": ("uneven", "decode step (1x1) at tp 3 of DeepSeek-V4-Flash's proportions (output "
                                         "groups 3, 3, 2): the slowest rank's median s / the mean of the ranks'"),
    "uneven_v4_forwards": ("uneven", "a count, not a timing: forwards tp 3 compiles per bucket of that model"),
    "wrong_forwards_caught": ("checks", "a fraction, not a timing: wrong forwards the check fails / all of them "
                                        "(every MoE family, float32 and bfloat16, a fixed list of mutations, at a "
                                        "one-token step and a range's checked shapes)"),
    "right_forward_draws_passed": ("checks", "a fraction, not a timing: random draws at a real router width whose "
                                             "compiled forward passes its check on both ranks / all draws"),
    "gate_scale_s": ("gate_scale", "a synthetic timing, not a ratio: gate run time on paper, 64 hosts x 8 ranks x "
                                   "67 buckets (median of 5), seconds"),
    "gate_scale_predicted_s": ("gate_scale", "a prediction, not a measurement: the gate's predicted compile wall "
                                             "for that layout, seconds"),
}

TARGETS: dict[str, Target] = {
    "fail_fast_ratio": Target("<=", 0.1),
    "compile_efficiency": Target(">=", 0.85),
    "pool_vs_loop_ratio": Target("<", 1.0),
    "warm_cold_ratio": Target("<=", 0.1),
    "overhead_ratio": Target("<=", 1.15),
    "store_upload_ratio": Target(">=", 0.9),
    "store_download_ratio": Target(">=", 0.9),
    "gate_scale_s": Target("<", 1.0),
    "compile_depth_ratio": Target("<=", 1.2),
    "scan_step_ratio": Target("<=", 1.05),
    "moe_step_ratio": Target("<=", 1.5),
    "moe_prefill_peak_ratio": Target("<=", 1.5),
    "moe_prefill_compile_ratio": Target("<=", 1.2),
    "rank_peak_ratio": Target("<=", 1.2),
    "rank_check_predicted_ratio": Target(">=", 1.0),
    "mla_step_ratio": Target("<=", 0.25),
    "s3_exact_rank_bytes_ratio": Target("<=", 1.05),
    "s3_loader_peak_ratio": Target("<=", 1.15),
    "ranges_compile_ratio": Target("<=", 0.15),
    "ranges_forwards": Target("<=", 4),
    "ranges_step_ratio": Target("<=", 1.05),
    "quantized_weight_bytes_ratio": Target("<=", 1.1),
    "quantized_decode_step_ratio": Target("<=", 2.0),
    "quantized_compile_ratio": Target("<=", 1.2),
    "mxfp4_weight_bytes_ratio": Target("<=", 1.1),
    "mxfp4_decode_step_ratio": Target("<=", 2.0),
    "mxfp4_compile_ratio": Target("<=", 1.2),
    "uneven_llama_step_balance": Target("<=", 1.15),
    "uneven_v4_step_balance": Target("<=", 1.15),
    "wrong_forwards_caught": Target(">=", 1.0),
    "right_forward_draws_passed": Target(">=", 1.0),
}


def targets_for(tp: int | None) -> dict[str, Target]:
    """The targets of this run: dedup's depends on the tp the export used (1/tp)."""
    out = dict(TARGETS)
    if tp:
        out["dedup_ratio"] = Target("==", 1.0 / tp)
    return out


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    """numerator / denominator, or None when either is missing or the denominator is not > 0."""
    if numerator is None or denominator is None or not denominator > 0:
        return None
    value = numerator / denominator
    return value if math.isfinite(value) else None


def median(values: list[float]) -> float | None:
    vals = [v for v in values if v is not None and math.isfinite(v)]
    return statistics.median(vals) if vals else None


def less(total: float | None, fixed: float | None) -> float | None:
    """`total` without a fixed cost, never below zero (None when either is unknown)."""
    if total is None or fixed is None:
        return None
    return max(0.0, total - fixed)


def compile_efficiency(compile_s: list[float], workers: int, phase_wall_s: float) -> dict:
    """Ideal compile wall (sum of per-forward seconds over the workers used) against the measured one."""
    ideal = sum(compile_s) / workers if workers > 0 else None
    return {"ideal_s": ideal, "phase_wall_s": phase_wall_s, "efficiency": ratio(ideal, phase_wall_s)}


def throughput_mib_s(num_bytes: int, seconds: float) -> float | None:
    return ratio(num_bytes / 2**20, seconds)


def round_floats(obj, digits: int = 4):
    """Round every float in a JSON-like structure to `digits` decimals (results stay readable); a float below
    10**-digits keeps `digits` significant figures instead (a max difference of 3e-06 must not read as 0)."""
    if isinstance(obj, float):
        if not math.isfinite(obj):
            return None
        return round(obj, digits) if abs(obj) >= 10 ** -digits or obj == 0 else float(f"{obj:.{digits}g}")
    if isinstance(obj, dict):
        return {k: round_floats(v, digits) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [round_floats(v, digits) for v in obj]
    return obj


def _fmt(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:.0f}"


def _value(name: str, figures: dict, spread: dict) -> str:
    """The median, and with several samples their range and count: `0.81 (0.78-0.86, n=3)`."""
    s = spread.get(name) or {}
    if (s.get("n") or 0) < 2:
        return _fmt(figures[name])
    return f"{_fmt(figures[name])} ({_fmt(s['min'])}-{_fmt(s['max'])}, n={s['n']})"


def render_markdown(result: dict) -> str:
    """The results table: every figure with its target and whether it was met, then notes and load."""
    figures = result.get("figures", {})
    spread = result.get("figure_samples", {})
    targets = {n: Target(t["op"], t["bound"]) for n, t in result.get("targets", {}).items()}
    m = result.get("machine", {})
    lines = [f"# Kiln bench {result.get('stamp', '')} ({result.get('mode', '')})", "",
             f"Parts: {', '.join(result.get('parts', []))}. Suite wall time: {_fmt(result.get('suite_s'))} s. "
             f"Machine: {m.get('cpus', '?')} CPUs, load average {_fmt(m.get('load_start'))} at start, "
             f"{_fmt(m.get('load_mean'))} mean / {_fmt(m.get('load_max'))} max during the run "
             f"(1-minute load average; {m.get('cpus', '?')} means the CPUs were fully busy). "
             f"Commit {m.get('commit') or 'unknown'}"
             f"{'' if not m.get('code_changed') else ' with uncommitted changes to ' + ', '.join(m['code_changed'])}. "
             "Each value is the median of its samples (range and count in brackets).", "",
             "| figure | value | target | met | compares |", "|---|---|---|---|---|"]
    for name, (part, what) in FIGURES.items():
        if name not in figures:
            continue
        target = targets.get(name)
        met = target.met(figures[name]) if target else None
        verdict = "-" if target is None else {True: "met", False: "**missed**", None: "n/a"}[met]
        lines.append(f"| `{name}` | {_value(name, figures, spread)} | {target or '-'} | {verdict} | {what} |")
    for name in sorted(set(figures) - set(FIGURES)):
        lines.append(f"| `{name}` | {_value(name, figures, spread)} | - | - | |")
    if result.get("errors"):
        lines += ["", "## Parts that failed", ""]
        lines += [f"- `{part}`: {msg}" for part, msg in result["errors"].items()]
    if result.get("notes"):
        lines += ["", "## What each measurement includes", ""]
        lines += [f"- **{part}**: {note}" for part, note in result["notes"].items()]
    return "\n".join(lines) + "\n"
