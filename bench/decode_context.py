"""A decode step against the context it attends to: 1024 cached tokens against 64.

`python -m bench.decode_context compile PAGES OUT_DIR` compiles the 1x1 (decode) forward of one rank (tp 2)
of the tiny model with PAGES pages of 16 tokens per sequence and writes OUT_DIR/pages-<PAGES>.json
{'compile_s', 'size_bytes'} (run each compile in a fresh process with a fresh Inductor cache).

`python -m bench.decode_context step OUT_DIR REPS STEPS P1 P2` loads both packages with the same random
weights and times STEPS decode steps of each at its full context (start_pos = PAGES x 16 - 1: every cached
position valid), REPS times, alternating which goes first; it writes OUT_DIR/step.json
{'P1': [s per step, ...], 'P2': [...]}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PAGES = (4, 64)
"""Pages per sequence compared: 64 and 1024 cached tokens."""
PAGE_TOKENS = 16
TP = 2


def _spec(pages: int) -> dict:
    from bench.specs import bench_spec
    from kiln.core.model.config import TINY

    return bench_spec(TINY, tp=TP, page_tokens=PAGE_TOKENS, pages_per_seq=pages)


def compile_one(pages: int, out: Path) -> dict:
    from kiln.host.compile.compiler import _warm, compile_forward

    _warm()
    out.mkdir(parents=True, exist_ok=True)
    result = compile_forward(_spec(pages), str(out / f"pages-{pages}.pt2"))
    return {"compile_s": result.compile_s, "size_bytes": result.size_bytes}


def step(out: Path, reps: int, steps: int, counts: tuple[int, ...]) -> dict:
    import torch

    from bench.alternating import alternate
    from kiln.core.model.config import TINY
    from kiln.host.ranks.loader import load_forward, place_weights
    from kiln.store import sha256_file
    from kiln.host.model import example_inputs, random_state_dict, shard_state_dict, solo_group

    torch.set_num_threads(1)
    weights = place_weights(shard_state_dict(random_state_dict(TINY), TINY, TP, 0), "cpu")
    with solo_group(), torch.no_grad():
        packages, args = {}, {}
        for p in counts:
            path = out / f"pages-{p}.pt2"
            packages[str(p)] = load_forward(path, weights, sha256_file(path))
            tokens, _, cache, table = example_inputs(TINY, TP, 1, 1, page_tokens=PAGE_TOKENS, pages_per_seq=p,
                                                     num_pages=p + 1)
            args[str(p)] = (tokens, torch.tensor([p * PAGE_TOKENS - 1]), cache, table)
        timed = alternate({name: lambda p=p, a=args[name]: p(*a) for name, p in packages.items()}, reps, steps)
    return timed.step_s


if __name__ == "__main__":
    if sys.argv[1] == "compile":
        pages, out = int(sys.argv[2]), Path(sys.argv[3])
        (out / f"pages-{pages}.json").write_text(json.dumps(compile_one(pages, out)))
    else:
        out = Path(sys.argv[2])
        counts = tuple(int(p) for p in sys.argv[5:])
        (out / "step.json").write_text(json.dumps(step(out, int(sys.argv[3]), int(sys.argv[4]), counts)))
