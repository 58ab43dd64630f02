"""Compile time against depth, and the cost of the scan at run time.

`python -m bench.depth_step compile LAYERS scan|unrolled OUT_DIR` compiles the
1x1 (decode) forward of a model of DEPTH_WIDTH's width at LAYERS layers, the
decoder layers as Kiln compiles them (one scan over stacked weights) or
unrolled (the same layers, one copy of the code per layer), and writes
OUT_DIR/<scan|unrolled>-<LAYERS>.json: {'compile_s', 'size_bytes'}. Run each compile in a fresh process with a
fresh Inductor cache (TORCHINDUCTOR_CACHE_DIR) so no side reuses another's work.

`python -m bench.depth_step step LAYERS OUT_DIR REPS STEPS` loads the scanned and the
unrolled package of the LAYERS-layer model, binds the same weights to both, and
times STEPS decode steps of each, REPS times, alternating which goes first;
it writes OUT_DIR/step.json: {'scan': [s per step, ...], 'unrolled': [...], 'max_abs_diff'}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

DEPTHS = (2, 8, 24)
"""The depths compared in a full run; the deepest is also the step comparison's."""
QUICK_DEPTHS = (1, 2)
"""`--quick`'s depths: a smoke test of the part, not its figure."""
TP = 2
PAGE_TOKENS, PAGES_PER_SEQ = 16, 4


def config(layers: int):
    """The depth bench's model: the tiny model's width (hidden 384, 24 heads, 12 KV heads) at `layers`."""
    from kiln.core.model.config import TINY

    return TINY.replace(num_layers=layers)


def _spec(layers: int) -> dict:
    from kiln.core.forwards.forward_keys import forward_spec
    from kiln.core.plan.recipe import Bucket
    from kiln.core.forwards.shape_ranges import static_shape
    from kiln.host.compile.key_sources import model_code_fingerprint
    from kiln.host.compile.inductor_options import COMPILER_OPTIONS

    return forward_spec(shapes=static_shape(Bucket(1, 1)), graph={"config": config(layers).to_dict(), "tp": TP,
                                                    "code": model_code_fingerprint()},
                        target="bench", torch_version="bench", page_tokens=PAGE_TOKENS, pages_per_seq=PAGES_PER_SEQ,
                        compiler=COMPILER_OPTIONS).to_dict()


def compile_one(layers: int, layout: str, out: Path) -> dict:
    """Compile one package (in this process, as a compile worker does) and say how long it took."""
    import kiln.host.model
    from kiln.host.compile.compiler import _warm, compile_forward

    _warm()
    out.mkdir(parents=True, exist_ok=True)
    if layout == "unrolled":  # the same module, its layers unrolled in Python while tracing
        scanned = kiln.host.model.ShardedDecoder

        class Unrolled(scanned):
            def __init__(self, cfg, tp=1, *, scan=True):
                super().__init__(cfg, tp, scan=False)

        kiln.host.model.ShardedDecoder = Unrolled
    result = compile_forward(_spec(layers), str(out / f"{layout}-{layers}.pt2"))
    return {"compile_s": result.compile_s, "size_bytes": result.size_bytes}


def step(layers: int, out: Path, reps: int, steps: int) -> dict:
    """Seconds per decode step at `layers`, scanned and unrolled, the same weights bound to both."""
    import torch

    from bench.alternating import alternate
    from kiln.host.ranks.loader import load_forward
    from kiln.store import sha256_file
    from kiln.host.model import example_inputs, random_state_dict, shard_state_dict, solo_group

    cfg = config(layers)
    torch.set_num_threads(1)
    with solo_group():  # one rank's partial sums, as the compile worker traced them
        weights = shard_state_dict(random_state_dict(cfg), cfg, TP, 0)
        packages = {name: load_forward(p, weights, sha256_file(p))
                    for name in ("scan", "unrolled") for p in [out / f"{name}-{layers}.pt2"]}
        args = example_inputs(cfg, TP, 1, 1, page_tokens=PAGE_TOKENS, pages_per_seq=PAGES_PER_SEQ,
                              num_pages=PAGES_PER_SEQ + 1)
        with torch.no_grad():
            timed = alternate({name: lambda p=p: p(*args) for name, p in packages.items()}, reps, steps)
    first = timed.warm  # the two layouts must agree
    diff = max(float((a - b).abs().max()) for a, b in zip(first["scan"], first["unrolled"]))
    return {**timed.step_s, "max_abs_diff": diff}


if __name__ == "__main__":
    if sys.argv[1] == "compile":
        layers, layout, out = int(sys.argv[2]), sys.argv[3], Path(sys.argv[4])
        (out / f"{layout}-{layers}.json").write_text(json.dumps(compile_one(layers, layout, out)))
    else:
        out = Path(sys.argv[3])
        (out / "step.json").write_text(json.dumps(step(int(sys.argv[2]), out, int(sys.argv[4]), int(sys.argv[5]))))
