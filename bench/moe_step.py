"""The decode step of a mixture of experts against its expert count: the compute follows the chosen experts.

`python -m bench.moe_step compile EXPERTS OUT_DIR [BUCKET]` compiles the BUCKET forward (default 1x1, decode;
PREFILL for the prefill figure) of one rank (tp 2) of a Qwen3-MoE model of the tiny model's width whose every
layer routes each token to the top 2 of EXPERTS experts, and writes OUT_DIR/experts-<EXPERTS>[-<BUCKET>].json:
{'compile_s', 'size_bytes'}. Run each compile in a fresh process with a fresh Inductor cache.

`python -m bench.moe_step step OUT_DIR REPS STEPS E1 E2` loads the two packages with random weights and
times STEPS decode steps of each, REPS times, alternating which goes first; it writes OUT_DIR/step.json:
{'E1': [s per step, ...], 'E2': [...]}.

`python -m bench.moe_step prefill OUT_DIR REPS E1 E2` does the same with the PREFILL packages, one step per
sample, and also records each step's peak memory: the growth of the process's peak resident memory (VmHWM,
reset just before the step) over what it held before it, i.e. what the step allocates beyond the weights. It
writes OUT_DIR/prefill.json: {'E1': {'s': [...], 'peak_bytes': [...]}, ...}. Run it with
MALLOC_MMAP_THRESHOLD_ fixed (PEAK_ENV), so freed activations leave the process and every step's peak is its own.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

EXPERTS = (4, 32)
"""The expert counts compared (top 2 of each): evaluating every expert would make the 32-expert step ~8x."""
TOP_K = 2
LAYERS = 2
TP = 2
PAGE_TOKENS, PAGES_PER_SEQ = 16, 4
PREFILL = (4, 32)
"""The prefill bucket (batch, tokens): 128 tokens, 256 (token, expert) pairs, far above the gathering threshold."""
PEAK_ENV = {"MALLOC_MMAP_THRESHOLD_": str(64 << 10)}
"""glibc serves every allocation of 64 KiB and more with its own mapping and unmaps it when freed (a fixed
threshold also stops glibc raising it), so one step's activations do not stay resident into the next."""


def config(experts: int):
    """The tiny model's width (hidden 384, 24 heads, 12 KV heads), Qwen3-MoE layers of `experts` experts."""
    from kiln.core.config import TINY

    return TINY.replace(architecture="qwen3_moe", qk_norm=True, num_layers=LAYERS, num_experts=experts,
                        experts_per_token=TOP_K, moe_intermediate_size=TINY.intermediate_size,
                        norm_topk_prob=True, moe_layers=tuple(range(LAYERS)))


def _name(experts: int, bucket: tuple[int, int]) -> str:
    return f"experts-{experts}" if bucket == (1, 1) else f"experts-{experts}-{bucket[0]}x{bucket[1]}"


def _spec(experts: int, bucket: tuple[int, int]) -> dict:
    from bench.specs import bench_spec

    return bench_spec(config(experts), tp=TP, bucket=bucket, page_tokens=PAGE_TOKENS, pages_per_seq=PAGES_PER_SEQ)


def compile_one(experts: int, out: Path, bucket: tuple[int, int] = (1, 1)) -> dict:
    from kiln.host.compiler import _warm, compile_forward

    _warm()
    out.mkdir(parents=True, exist_ok=True)
    result = compile_forward(_spec(experts, bucket), str(out / f"{_name(experts, bucket)}.pt2"))
    return {"compile_s": result.compile_s, "size_bytes": result.size_bytes}


def step(out: Path, reps: int, steps: int, counts: tuple[int, ...], bucket: tuple[int, int] = (1, 1)) -> dict:
    """{experts: {'s': [seconds per step, ...], 'peak_bytes': [one step's peak growth, ...]}}."""
    import torch

    from bench.loader_peak import peak_growth_bytes
    from kiln.host.loader import load_forward
    from kiln.store import sha256_file
    from kiln.host.model import example_inputs, random_state_dict, shard_state_dict, solo_group

    torch.set_num_threads(1)
    samples: dict[str, dict[str, list]] = {str(e): {"s": [], "peak_bytes": []} for e in counts}
    with solo_group():
        packages, args = {}, {}
        for e in counts:
            cfg = config(e)
            path = out / f"{_name(e, bucket)}.pt2"
            packages[str(e)] = load_forward(path, shard_state_dict(random_state_dict(cfg), cfg, TP, 0), sha256_file(path))
            args[str(e)] = example_inputs(cfg, TP, *bucket, page_tokens=PAGE_TOKENS, pages_per_seq=PAGES_PER_SEQ,
                                          num_pages=PAGES_PER_SEQ * bucket[0] + 1)
        with torch.no_grad():
            for name, p in packages.items():
                p(*args[name])  # warm
            for i in range(reps):
                for name in (list(samples) if i % 2 == 0 else list(samples)[::-1]):
                    start = time.perf_counter()
                    for _ in range(steps):
                        packages[name](*args[name])
                    samples[name]["s"].append((time.perf_counter() - start) / steps)
                    samples[name]["peak_bytes"].append(peak_growth_bytes(lambda: packages[name](*args[name])))
    return samples


if __name__ == "__main__":
    if sys.argv[1] == "compile":
        experts, out = int(sys.argv[2]), Path(sys.argv[3])
        bucket = tuple(int(n) for n in sys.argv[4].split("x")) if len(sys.argv) > 4 else (1, 1)
        (out / f"{_name(experts, bucket)}.json").write_text(json.dumps(compile_one(experts, out, bucket)))
    elif sys.argv[1] == "prefill":
        out = Path(sys.argv[2])
        counts = tuple(int(e) for e in sys.argv[4:])
        (out / "prefill.json").write_text(json.dumps(step(out, int(sys.argv[3]), 1, counts, PREFILL)))
    else:
        out = Path(sys.argv[2])
        counts = tuple(int(e) for e in sys.argv[5:])
        (out / "step.json").write_text(json.dumps(step(out, int(sys.argv[3]), int(sys.argv[4]), counts)))
