"""Ranks of unequal shares at tp 3: how evenly their decode steps take (bench part `uneven`).

`python -m bench.uneven_step compile MODEL OUT_DIR I` compiles the decode forward (1x1) of the I-th distinct rank
shape of `config(MODEL)` at tp 3 (kiln.core.model.shares.graph_shares: its graph names the share) into
OUT_DIR/<MODEL>-<I>.pt2 with OUT_DIR/<MODEL>-<I>.json ({'compile_s', 'ranks', 'share'}). Run each in a fresh
process and Inductor cache.

`python -m bench.uneven_step step MODEL OUT_DIR OUT_JSON REPS STEPS` binds each rank's own constants (random
weights, one draw cut three ways) to its shape's package and times STEPS decode steps of each rank, REPS
rounds, rotating which goes first, in one process on one thread (the all-reduce over a group of one: a rank's
own work, what the slowest rank holds the others to): {rank: {'s': [s per step, ...]}}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TP, LAYERS = 3, 2
PAGE_TOKENS, PAGES_PER_SEQ = 16, 8
MODELS = ("llama", "v4")


def config(model: str):
    """llama: Llama-3.1-8B's widths (hidden 4096, 32 query heads and 8 KV heads of 128, MLP 14336) at 2 layers,
    its vocabulary cut to 8192 so the replicated head weighs in a step what 128256 does at its 32 layers;
    v4: DeepSeek-V4-Flash's proportions at a quarter width (hidden 1024, 16 heads of 128 in 8 output groups
    of rank 256, 16 experts of 512, top 4, a sliding and a compressed layer), vocabulary 8192. bfloat16."""
    from kiln.core.model.config import ModelConfig
    from kiln.core.model.hf_config import from_hf

    if model == "llama":
        return ModelConfig(architecture="llama", vocab_size=8192, hidden_size=4096, num_layers=LAYERS, num_heads=32,
                           num_kv_heads=8, head_dim=128, intermediate_size=14336, dtype="bfloat16")
    return from_hf({"model_type": "deepseek_v4", "vocab_size": 8192, "hidden_size": 1024, "num_hidden_layers": LAYERS,
                    "num_attention_heads": 16, "head_dim": 128, "o_groups": 8, "o_lora_rank": 256,
                    "q_lora_rank": 256, "n_routed_experts": 16, "num_experts_per_tok": 4,
                    "moe_intermediate_size": 512, "index_n_heads": 8, "index_head_dim": 64, "index_topk": 16,
                    "layer_types": ["sliding_attention", "compressed_sparse_attention"],
                    "mlp_layer_types": ["moe", "moe"], "sliding_window": 64, "torch_dtype": "bfloat16"})


def package_name(model: str, index: int) -> str:
    return f"{model}-{index}"


def compile_one(model: str, out: Path, index: int) -> dict:
    from bench.specs import bench_spec
    from kiln.core.model.shares import graph_shares
    from kiln.host.compile.compiler import _warm, compile_forward

    _warm()
    out.mkdir(parents=True, exist_ok=True)
    cfg = config(model)
    share = graph_shares(cfg, TP)[index]
    spec = bench_spec(cfg, tp=TP, bucket=(1, 1), page_tokens=PAGE_TOKENS, pages_per_seq=PAGES_PER_SEQ, share=share)
    result = compile_forward(spec, str(out / f"{package_name(model, index)}.pt2"))
    return {"compile_s": result.compile_s, "ranks": share["ranks"], "share": share, "key": spec["key"]}


def step(model: str, out: Path, reps: int, steps: int) -> dict:
    import torch

    from bench.alternating import alternate
    from kiln.core.model.shares import graph_shares
    from kiln.host.model import example_inputs, random_state_dict, shard_state_dict, solo_group
    from kiln.host.ranks.loader import load_forward
    from kiln.store import sha256_file

    torch.set_num_threads(1)
    cfg = config(model)
    full = random_state_dict(cfg)
    with solo_group():
        calls = {}
        for index, share in enumerate(graph_shares(cfg, TP)):
            path = out / f"{package_name(model, index)}.pt2"
            for rank in share["ranks"]:
                forward = load_forward(path, shard_state_dict(full, cfg, TP, rank), sha256_file(path))
                args = example_inputs(cfg, TP, 1, 1, page_tokens=PAGE_TOKENS, pages_per_seq=PAGES_PER_SEQ,
                                      num_pages=PAGES_PER_SEQ + 1, rank=rank)
                calls[str(rank)] = lambda f=forward, a=args: f(*a)
        del full
        with torch.no_grad():
            timed = alternate(dict(sorted(calls.items())), reps, steps)
    return {rank: {"s": timed.step_s[rank]} for rank in sorted(calls)}


if __name__ == "__main__":
    if sys.argv[1] == "compile":
        model, out, index = sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
        (out / f"{package_name(model, index)}.json").write_text(json.dumps(compile_one(model, out, index)))
    else:
        model, out = sys.argv[2], Path(sys.argv[3])
        Path(sys.argv[4]).write_text(json.dumps(step(model, out, int(sys.argv[5]), int(sys.argv[6]))))
