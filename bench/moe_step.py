"""The decode step of a mixture of experts against its expert count: the compute follows the chosen experts.

`python -m bench.moe_step compile EXPERTS OUT_DIR` compiles the 1x1 (decode) forward of one rank (tp 2) of
a Qwen3-MoE model of the tiny model's width whose every layer routes each token to the top 2 of EXPERTS
experts, and writes OUT_DIR/experts-<EXPERTS>.json: {'compile_s', 'size_bytes'}. Run each compile in a fresh
process with a fresh Inductor cache.

`python -m bench.moe_step step OUT_DIR REPS STEPS E1 E2` loads the two packages with random weights and
times STEPS decode steps of each, REPS times, alternating which goes first; it writes OUT_DIR/step.json:
{'E1': [s per step, ...], 'E2': [...]}.
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


def config(experts: int):
    """The tiny model's width (hidden 384, 24 heads, 12 KV heads), Qwen3-MoE layers of `experts` experts."""
    from kiln.core.config import TINY

    return TINY.replace(architecture="qwen3_moe", qk_norm=True, num_layers=LAYERS, num_experts=experts,
                        experts_per_token=TOP_K, moe_intermediate_size=TINY.intermediate_size,
                        norm_topk_prob=True, moe_layers=tuple(range(LAYERS)))


def _spec(experts: int) -> dict:
    from kiln.core.forward_keys import forward_spec
    from kiln.core.recipe import Bucket
    from kiln.core.shape_ranges import static_shape
    from kiln.host.compiler import model_code_fingerprint
    from kiln.host.inductor_options import COMPILER_OPTIONS

    return forward_spec(shapes=static_shape(Bucket(1, 1)), graph={"config": config(experts).to_dict(), "tp": TP,
                                                    "code": model_code_fingerprint()},
                        target="bench", torch_version="bench", page_tokens=PAGE_TOKENS, pages_per_seq=PAGES_PER_SEQ,
                        compiler=COMPILER_OPTIONS).to_dict()


def compile_one(experts: int, out: Path) -> dict:
    from kiln.host.compiler import _warm, compile_forward

    _warm()
    out.mkdir(parents=True, exist_ok=True)
    result = compile_forward(_spec(experts), str(out / f"experts-{experts}.pt2"))
    return {"compile_s": result.compile_s, "size_bytes": result.size_bytes}


def step(out: Path, reps: int, steps: int, counts: tuple[int, ...]) -> dict:
    import torch

    from kiln.host.loader import load_forward, sha256_of
    from kiln.host.model import example_inputs, random_state_dict, shard_state_dict, solo_group

    torch.set_num_threads(1)
    samples: dict[str, list[float]] = {str(e): [] for e in counts}
    with solo_group():
        packages, args = {}, {}
        for e in counts:
            cfg = config(e)
            path = out / f"experts-{e}.pt2"
            packages[str(e)] = load_forward(path, shard_state_dict(random_state_dict(cfg), cfg, TP, 0), sha256_of(path))
            args[str(e)] = example_inputs(cfg, TP, 1, 1, page_tokens=PAGE_TOKENS, pages_per_seq=PAGES_PER_SEQ,
                                          num_pages=PAGES_PER_SEQ + 1)
        with torch.no_grad():
            for name, p in packages.items():
                p(*args[name])  # warm
            for i in range(reps):
                for name in (list(samples) if i % 2 == 0 else list(samples)[::-1]):
                    start = time.perf_counter()
                    for _ in range(steps):
                        packages[name](*args[name])
                    samples[name].append((time.perf_counter() - start) / steps)
    return samples


if __name__ == "__main__":
    if sys.argv[1] == "compile":
        experts, out = int(sys.argv[2]), Path(sys.argv[3])
        (out / f"experts-{experts}.json").write_text(json.dumps(compile_one(experts, out)))
    else:
        out = Path(sys.argv[2])
        counts = tuple(int(e) for e in sys.argv[5:])
        (out / "step.json").write_text(json.dumps(step(out, int(sys.argv[3]), int(sys.argv[4]), counts)))
