"""Quantized weights against the same model in bfloat16: what a rank holds, what its forwards compile in, how fast
they step (bench part `quantized`): FP8 blocks (Qwen3-30B-A3B's widths) and gpt-oss's MXFP4 experts (gpt-oss-20b's).

`python -m bench.quantized_step compile FORMAT OUT_DIR BUCKET` compiles the BUCKET forward (e.g. 1x1) of one rank
(tp 2) of `config(FORMAT)` (FORMAT "fp8": the published FP8-block layout, 128 x 128 blocks with float32 scales;
"bf16": the same model unquantized; "mxfp4": gpt-oss's published layout, MXFP4 experts; "oss-bf16": the same
model unquantized) and writes OUT_DIR/<name>.pt2 and OUT_DIR/<name>.json ({'compile_s',
'format', 'bucket', 'held_bytes', 'checkpoint_slice_bytes', 'planned_bytes'}; held: the rank's constants'
bytes as Kiln's loader holds them; slices: what it reads of the checkpoint). Run each in a fresh process and Inductor cache.

`python -m bench.quantized_step step OUT_JSON REPS STEPS PKG...` binds each package's rank constants (random
weights, the same draw quantized or not) and times STEPS calls of each, REPS times, rotating which goes
first: {PKG: {'s': [s per call, ...]}}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PAIRS = (("fp8", "bf16"), ("mxfp4", "oss-bf16"))
"""Each quantized format with its unquantized twin."""
FORMATS = tuple(fmt for pair in PAIRS for fmt in pair)
LAYERS, TP, EXPERTS, TOP_K = 2, 2, 32, 8
OSS_TOP_K = 4
PAGE_TOKENS, PAGES_PER_SEQ = 16, 8
BUCKETS = ((1, 1), (1, 64))
"""Decode (one token) and a prefill chunk of 64 tokens."""


def config(fmt: str):
    """gpt-oss-20b's widths for "mxfp4" and "oss-bf16" (oss_config); else Qwen3-30B-A3B's widths (hidden 2048, 32 query heads and 4 KV heads of 128, experts 768 wide, top 8, a
    vocabulary of 32000) at 2 layers and 32 experts (of its 128: the bfloat16 twin and the compiles fit this
    machine), bfloat16 compute; `fmt` fp8: its projections FP8 blocks of 128 x 128."""
    from kiln.core.model.config import ModelConfig
    from kiln.core.model.quant import FP8_BLOCKS, WeightQuant

    if fmt in PAIRS[1]:
        return oss_config(fmt)
    cfg = ModelConfig(architecture="qwen3_moe", vocab_size=32000, hidden_size=2048, num_layers=LAYERS, num_heads=32,
                      num_kv_heads=4, head_dim=128, intermediate_size=6144, dtype="bfloat16", qk_norm=True,
                      num_experts=EXPERTS, experts_per_token=TOP_K, moe_intermediate_size=768, norm_topk_prob=True,
                      moe_layers=tuple(range(LAYERS)))
    return cfg.replace(quant=WeightQuant(FP8_BLOCKS, (128, 128))) if fmt == "fp8" else cfg


def oss_config(fmt: str):
    """gpt-oss-20b's widths (hidden 2880, 64 query and 8 KV heads of 64, 32 experts 2880 wide, top 4, a sliding
    and a full layer) at 2 layers and a vocabulary of 32000 (of its 201088), bfloat16 compute; `fmt` mxfp4: its
    experts MXFP4, as published."""
    from kiln.core.model.config import ModelConfig
    from kiln.core.model.quant import MXFP4, WeightQuant

    cfg = ModelConfig(architecture="gpt_oss", vocab_size=32000, hidden_size=2880, num_layers=LAYERS, num_heads=64,
                      num_kv_heads=8, head_dim=64, intermediate_size=2880, dtype="bfloat16", qkv_bias=True,
                      o_bias=True, sliding_window=128, full_attention_layers=(1,), num_experts=EXPERTS,
                      experts_per_token=OSS_TOP_K, moe_intermediate_size=2880, norm_topk_prob=True,
                      moe_layers=tuple(range(LAYERS)), attention_sinks=True, swiglu_limit=7.0, rope_type="yarn",
                      rope_theta=150000.0, rope_factor=32.0, rope_original_max_position=4096, rope_truncate=False,
                      rope_attention_factor=1.3465735902799727)
    return cfg.replace(quant=WeightQuant(MXFP4, (1, 32))) if fmt == "mxfp4" else cfg


def package_name(fmt: str, bucket: tuple[int, int]) -> str:
    return f"{fmt}-{bucket[0]}x{bucket[1]}"


def rank_weights(fmt: str) -> dict:
    """Rank 0's constants of `config(fmt)`, from one random draw (quantized for fp8; random bytes for mxfp4)."""
    from kiln.host.model import random_state_dict, shard_state_dict

    cfg = config(fmt)
    return shard_state_dict(random_state_dict(cfg), cfg, TP, 0)


def checkpoint_slice_bytes(cfg, tp: int, rank: int) -> int:
    """The bytes `rank` reads of the checkpoint (its cut of every tensor in the checkpoint's dtype; a scale
    repeated over a rank's sub-blocks counted once)."""
    import math

    import torch

    from kiln.core.model.contract import constant_dtype, parameter_shapes, rank_reads

    full, total = parameter_shapes(cfg), 0
    for sources in rank_reads(cfg, tp, rank).values():
        for tensor, cut in sources:
            shape = list(full[tensor])
            if cut is not None:
                dim, start, stop, *repeat = cut
                r = repeat[0] if repeat else 1
                shape[dim] = -(-stop // r) - start // r
            total += math.prod(shape) * getattr(torch, constant_dtype(cfg, tensor)).itemsize
    return total


def compile_one(fmt: str, out: Path, bucket: tuple[int, int]) -> dict:
    from bench.specs import bench_spec
    from kiln.core.model.rank_bytes import weight_bytes_per_rank
    from kiln.host.compile.compiler import _warm, compile_forward

    _warm()
    out.mkdir(parents=True, exist_ok=True)
    cfg = config(fmt)
    spec = bench_spec(cfg, tp=TP, bucket=bucket, page_tokens=PAGE_TOKENS, pages_per_seq=PAGES_PER_SEQ)
    result = compile_forward(spec, str(out / f"{package_name(fmt, bucket)}.pt2"))
    held = sum(t.nbytes for t in rank_weights(fmt).values())
    return {"compile_s": result.compile_s, "format": fmt, "bucket": list(bucket), "held_bytes": held,
            "checkpoint_slice_bytes": checkpoint_slice_bytes(cfg, TP, 0),
            "planned_bytes": weight_bytes_per_rank(cfg, TP)}


def step(packages: list[Path], reps: int, steps: int) -> dict:
    import torch

    from bench.alternating import alternate
    from kiln.host.model import example_inputs, solo_group
    from kiln.host.ranks.loader import load_forward
    from kiln.store import sha256_file

    torch.set_num_threads(1)
    with solo_group():
        calls = {}
        for path in packages:
            info = json.loads(path.with_suffix(".json").read_text())
            cfg, bucket = config(info["format"]), tuple(info["bucket"])
            forward = load_forward(path, rank_weights(info["format"]), sha256_file(path))
            args = example_inputs(cfg, TP, *bucket, page_tokens=PAGE_TOKENS, pages_per_seq=PAGES_PER_SEQ,
                                  num_pages=PAGES_PER_SEQ * bucket[0] + 1)
            calls[str(path)] = lambda f=forward, a=args: f(*a)
        with torch.no_grad():
            timed = alternate(calls, reps, steps)
    return {name: {"s": timed.step_s[name]} for name in calls}


if __name__ == "__main__":
    if sys.argv[1] == "compile":
        fmt, out, bucket = sys.argv[2], Path(sys.argv[3]), tuple(int(n) for n in sys.argv[4].split("x"))
        (out / f"{package_name(fmt, bucket)}.json").write_text(json.dumps(compile_one(fmt, out, bucket)))
    else:
        Path(sys.argv[2]).write_text(json.dumps(step([Path(p) for p in sys.argv[5:]], int(sys.argv[3]),
                                                     int(sys.argv[4]))))
