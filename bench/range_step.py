"""One compile for many shapes: the incident's bucket list compiled as ranges against one package per bucket.

`python -m bench.range_step compile OUT_DIR SIDE NAME...` compiles, in this one process (as one compile
worker does, its Inductor cache fresh when the caller gives it a fresh TORCHINDUCTOR_CACHE_DIR), the
forwards NAME... (kiln.core.forwards.shape_ranges names: `8x1`, `2-256x1@256x1`) of the tiny model's tp 2 shard, one
after another, and writes OUT_DIR/<SIDE>.json: {name: {'compile_s', 'size_bytes'}}.

`python -m bench.range_step step OUT_DIR REPS STEPS SHAPE=STATIC,RANGE ...` loads each pair's static and
range package, binds the same weights to both and times STEPS steps of each at SHAPE, REPS times,
alternating which goes first; it writes OUT_DIR/step.json: {SHAPE: {'static': [s per step], 'range': [...],
'max_abs_diff'}}.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TP = 2
PAGE_TOKENS, PAGES_PER_SEQ = 16, 4


def incident_buckets():
    """38 buckets: the decode batches a serving engine captures (1, 2, 4, then every 8 up to 256, the
    gate_scale part's spacing) and three prefill lengths up to 512."""
    from kiln.core.plan.recipe import Bucket

    return tuple(Bucket(b, 1) for b in (1, 2, 4, *range(8, 257, 8))) + tuple(Bucket(1, t) for t in (128, 256, 512))


def spec(name: str) -> dict:
    from kiln.core.model.config import TINY
    from kiln.core.forwards.forward_keys import forward_spec
    from kiln.core.forwards.shape_ranges import parse_shape_range
    from kiln.host.compile.key_sources import model_code_fingerprint
    from kiln.host.compile.inductor_options import COMPILER_OPTIONS

    return forward_spec(shapes=parse_shape_range(name), graph={"config": TINY.to_dict(), "tp": TP,
                                                                "code": model_code_fingerprint()},
                        target="bench", torch_version="bench", page_tokens=PAGE_TOKENS, pages_per_seq=PAGES_PER_SEQ,
                        compiler=COMPILER_OPTIONS).to_dict()


def compile_side(out: Path, names: list[str]) -> dict:
    from kiln.host.compile.compiler import _warm, compile_forward
    from kiln.host.model import solo_group

    _warm()
    out.mkdir(parents=True, exist_ok=True)
    done = {}
    with solo_group():
        for name in names:
            result = compile_forward(spec(name), str(out / f"{spec(name)['key']}.pt2"))
            done[name] = {"compile_s": result.compile_s, "size_bytes": result.size_bytes}
    return done


def step(out: Path, reps: int, steps: int, pairs: dict[str, tuple[str, str]]) -> dict:
    """Seconds per step at each shape: its static package against the range package that holds it."""
    import torch

    from bench.alternating import alternate
    from kiln.core.model.config import TINY
    from kiln.core.forwards.shape_ranges import parse_shape_range
    from kiln.host.ranks.loader import load_forward
    from kiln.store import sha256_file
    from kiln.host.model import example_inputs, random_state_dict, shard_state_dict, solo_group

    torch.set_num_threads(1)
    result = {}
    with solo_group():
        weights = shard_state_dict(random_state_dict(TINY), TINY, TP, 0)
        for shape, (static, ranged) in pairs.items():
            packages = {side: load_forward(p, weights, sha256_file(p))
                        for side, name in (("static", static), ("range", ranged))
                        for p in [out / f"{spec(name)['key']}.pt2"]}
            b = parse_shape_range(shape).hint
            args = example_inputs(TINY, TP, b.batch, b.tokens, page_tokens=PAGE_TOKENS, pages_per_seq=PAGES_PER_SEQ,
                                  num_pages=PAGES_PER_SEQ * b.batch + 1)
            with torch.no_grad():
                timed = alternate({side: lambda p=p: p(*args) for side, p in packages.items()}, reps, steps)
            first = timed.warm  # the two sides must agree
            diff = max(float((x - y).abs().max()) for x, y in zip(first["static"], first["range"]))
            result[shape] = {**timed.step_s, "max_abs_diff": diff}
    return result


if __name__ == "__main__":
    out = Path(sys.argv[2])
    if sys.argv[1] == "compile":
        (out / f"{sys.argv[3]}.json").write_text(json.dumps(compile_side(out, sys.argv[4:])))
    else:
        pairs = {p.split("=")[0]: tuple(p.split("=")[1].split(",")) for p in sys.argv[5:]}
        (out / "step.json").write_text(json.dumps(step(out, int(sys.argv[3]), int(sys.argv[4]), pairs)))
