"""Latent attention's decode step at a long context: the cached latents read as they are (absorbed) or
projected up to every head's keys and values first (expanded, transformers' order).

`python -m bench.mla_step compile ORDER OUT_DIR` compiles the 1x1 (decode) forward of one rank (tp 2) of a
two-layer DeepSeek-V3-like model (latent attention at DeepSeek-V2-Lite's head sizes, dense MLPs) over a
CONTEXT_TOKENS context, with its latent attention in ORDER (absorbed, as Kiln picks for decode, or expanded,
forced), and writes OUT_DIR/<ORDER>.json: {'compile_s', 'size_bytes'}. Run each compile in a fresh process
with a fresh Inductor cache.

`python -m bench.mla_step step OUT_DIR REPS STEPS` loads both packages with the same random weights and times
STEPS decode steps of each on the same full context, REPS times, alternating which goes first; it writes
OUT_DIR/step.json: {'absorbed': [s per step, ...], 'expanded': [...], 'max_abs_diff': float}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ORDERS = ("absorbed", "expanded")
TP = 2
PAGE_TOKENS = 16
CONTEXT_TOKENS = 1024
PAGES_PER_SEQ = CONTEXT_TOKENS // PAGE_TOKENS


def config():
    """Two layers of latent attention at DeepSeek-V2-Lite's head sizes (16 heads of 128 + 64, values of 128, a
    latent of 512, no q bottleneck) over the tiny model's width and vocabulary, dense MLPs."""
    from kiln.core.model.config import TINY

    return TINY.replace(architecture="deepseek_v3", num_layers=2, num_heads=16, num_kv_heads=16, head_dim=192,
                        qk_rope_head_dim=64, v_head_dim=128, kv_lora_rank=512, rope_interleave=True,
                        rms_norm_eps=1e-6)


def _spec() -> dict:
    from kiln.core.forwards.forward_keys import forward_spec
    from kiln.core.plan.recipe import Bucket
    from kiln.core.forwards.shape_ranges import static_shape
    from kiln.host.compile.key_sources import model_code_fingerprint
    from kiln.host.compile.inductor_options import COMPILER_OPTIONS

    return forward_spec(shapes=static_shape(Bucket(1, 1)), graph={"config": config().to_dict(), "tp": TP,
                                                    "code": model_code_fingerprint()},
                        target="bench", torch_version="bench", page_tokens=PAGE_TOKENS, pages_per_seq=PAGES_PER_SEQ,
                        compiler=COMPILER_OPTIONS).to_dict()


def compile_one(order: str, out: Path) -> dict:
    import kiln.host.model.layers.latent_attention as mla
    from kiln.host.compile.compiler import _warm, compile_forward

    _warm()
    out.mkdir(parents=True, exist_ok=True)
    cfg = config()
    chosen = mla.absorbs(cfg, cfg.num_heads // TP, 1, CONTEXT_TOKENS + 1)
    assert chosen, "Kiln itself should absorb a decode step at this context"
    if order == "expanded":  # the same module, traced in transformers' order
        mla.absorbs = lambda *args: False
    result = compile_forward(_spec(), str(out / f"{order}.pt2"))
    return {"compile_s": result.compile_s, "size_bytes": result.size_bytes}


def step(out: Path, reps: int, steps: int) -> dict:
    import torch

    from bench.alternating import alternate
    from kiln.host.ranks.loader import load_forward
    from kiln.store import sha256_file
    from kiln.host.model import example_inputs, random_state_dict, shard_state_dict, solo_group

    cfg = config()
    torch.set_num_threads(1)
    with solo_group():  # one rank's partial sums, as the compile worker traced them
        weights = shard_state_dict(random_state_dict(cfg), cfg, TP, 0)
        packages = {order: load_forward(p, weights, sha256_file(p)) for order in ORDERS for p in [out / f"{order}.pt2"]}
        tok, _, cache, table = example_inputs(cfg, TP, 1, 1, page_tokens=PAGE_TOKENS, pages_per_seq=PAGES_PER_SEQ,
                                              num_pages=PAGES_PER_SEQ + 1)
        start = torch.tensor([CONTEXT_TOKENS - 1])  # the whole context cached: the step attends to all of it
        table = torch.arange(PAGES_PER_SEQ)[None]
        with torch.no_grad():
            timed = alternate({order: lambda p=p: p(tok, start, cache, table) for order, p in packages.items()},
                              reps, steps)
    outs = {order: out[0] for order, out in timed.warm.items()}
    return {**timed.step_s, "max_abs_diff": float((outs["absorbed"] - outs["expanded"]).abs().max())}


if __name__ == "__main__":
    if sys.argv[1] == "compile":
        order, out = sys.argv[2], Path(sys.argv[3])
        (out / f"{order}.json").write_text(json.dumps(compile_one(order, out)))
    else:
        out = Path(sys.argv[2])
        (out / "step.json").write_text(json.dumps(step(out, int(sys.argv[3]), int(sys.argv[4]))))
