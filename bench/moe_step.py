"""A mixture of experts' compiles and steps against its expert count: the compute follows the chosen experts.

`python -m bench.moe_step compile EXPERTS OUT_DIR [BUCKET [DTYPE]]` compiles the BUCKET forward (default 1x1,
decode; PREFILL for the prefill figures) of one rank (tp 2) of a Qwen3-MoE model of the tiny model's width in
DTYPE (default DTYPE) whose every layer routes each token to the top 2 of EXPERTS experts, and writes
OUT_DIR/<name>.pt2 and OUT_DIR/<name>.json: {'compile_s', 'size_bytes', 'experts', 'bucket', 'dtype',
'python_free'}, <name> being `package_name`. Run each compile in a fresh process with a fresh Inductor
cache. The module compiles with whatever `kiln` is on the path, so the same command run against another
checkout compiles its code.

`python -m bench.moe_step step OUT_JSON REPS STEPS PKG...` loads the packages (.pt2 paths, each with its
.json beside it) with random weights and times STEPS steps of each, REPS times, rotating which goes first,
and records each step's peak memory: the growth of the process's peak resident memory (VmHWM, reset just
before a step) over what it held before it, i.e. what the step allocates beyond the weights. It writes
OUT_JSON: {PKG: {'s': [s per step, ...], 'peak_bytes': [...]}, ...}. Run it with MALLOC_MMAP_THRESHOLD_ fixed
(PEAK_ENV), so freed activations leave the process and every step's peak is its own.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

EXPERTS = (4, 32)
"""The expert counts whose steps are compared (top 2 of each): evaluating every expert would make the
32-expert step ~8x."""
COMPILE_EXPERTS = (4, 32, 128)
"""The expert counts whose prefill compiles are compared."""
DTYPE = "bfloat16"
"""The models' dtype: that of real MoE checkpoints, and the one prefill's grouped multiplies trace in."""
TOP_K = 2
LAYERS = 2
TP = 2
PAGE_TOKENS, PAGES_PER_SEQ = 16, 4
PREFILL = (4, 32)
"""The prefill bucket (batch, tokens): 128 tokens, 256 (token, expert) pairs, far above the gathering threshold."""
PEAK_ENV = {"MALLOC_MMAP_THRESHOLD_": str(64 << 10)}
"""glibc serves every allocation of 64 KiB and more with its own mapping and unmaps it when freed (a fixed
threshold also stops glibc raising it), so one step's activations do not stay resident into the next."""


def config(experts: int, dtype: str = DTYPE):
    """The tiny model's width (hidden 384, 24 heads, 12 KV heads), Qwen3-MoE layers of `experts` experts."""
    from kiln.core.model.config import TINY

    return TINY.replace(architecture="qwen3_moe", dtype=dtype, qk_norm=True, num_layers=LAYERS, num_experts=experts,
                        experts_per_token=TOP_K, moe_intermediate_size=TINY.intermediate_size,
                        norm_topk_prob=True, moe_layers=tuple(range(LAYERS)))


def package_name(experts: int, bucket: tuple[int, int] = (1, 1), dtype: str = DTYPE) -> str:
    return f"experts-{experts}-{bucket[0]}x{bucket[1]}-{dtype}"


def compile_one(experts: int, out: Path, bucket: tuple[int, int] = (1, 1), dtype: str = DTYPE) -> dict:
    from bench.specs import bench_spec
    from kiln.host.compile.compiler import _warm, compile_forward

    _warm()
    out.mkdir(parents=True, exist_ok=True)
    spec = bench_spec(config(experts, dtype), tp=TP, bucket=bucket, page_tokens=PAGE_TOKENS,
                      pages_per_seq=PAGES_PER_SEQ)
    result = compile_forward(spec, str(out / f"{package_name(experts, bucket, dtype)}.pt2"))
    return {"compile_s": result.compile_s, "size_bytes": result.size_bytes, "experts": experts,
            "bucket": list(bucket), "dtype": dtype, "python_free": (result.calls or {}).get("python_free")}


def step(packages: list[Path], reps: int, steps: int) -> dict:
    """{package path: {'s': [seconds per step, ...], 'peak_bytes': [one step's peak growth, ...]}}."""
    import torch

    from bench.alternating import alternate
    from bench.loader_peak import peak_growth_bytes
    from kiln.host.ranks.loader import load_forward
    from kiln.store import sha256_file
    from kiln.host.model import example_inputs, random_state_dict, shard_state_dict, solo_group

    torch.set_num_threads(1)
    peak_bytes: dict[str, list[int]] = {str(path): [] for path in packages}
    with solo_group():
        loaded, args = {}, {}
        for path in packages:
            info = json.loads(path.with_suffix(".json").read_text())
            cfg, bucket = config(info["experts"], info["dtype"]), tuple(info["bucket"])
            loaded[str(path)] = load_forward(path, shard_state_dict(random_state_dict(cfg), cfg, TP, 0),
                                             sha256_file(path))
            args[str(path)] = example_inputs(cfg, TP, *bucket, page_tokens=PAGE_TOKENS,
                                             pages_per_seq=PAGES_PER_SEQ, num_pages=PAGES_PER_SEQ * bucket[0] + 1)
        calls = {name: lambda p=p, a=args[name]: p(*a) for name, p in loaded.items()}
        with torch.no_grad():
            timed = alternate(calls, reps, steps, after=lambda name: peak_bytes[name].append(
                peak_growth_bytes(calls[name])))
    return {name: {"s": timed.step_s[name], "peak_bytes": peak_bytes[name]} for name in peak_bytes}


if __name__ == "__main__":
    if sys.argv[1] == "compile":
        experts, out = int(sys.argv[2]), Path(sys.argv[3])
        bucket = tuple(int(n) for n in sys.argv[4].split("x")) if len(sys.argv) > 4 else (1, 1)
        dtype = sys.argv[5] if len(sys.argv) > 5 else DTYPE
        (out / f"{package_name(experts, bucket, dtype)}.json").write_text(
            json.dumps(compile_one(experts, out, bucket, dtype)))
    else:
        Path(sys.argv[2]).write_text(json.dumps(step([Path(p) for p in sys.argv[5:]], int(sys.argv[3]),
                                                     int(sys.argv[4]))))
