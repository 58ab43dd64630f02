"""The plain loop: compile the export's buckets one after another in this one process.

`python -m bench.loop --model DIR --tp N --buckets 1x8,... --out DIR --json FILE`

What a user would write without Kiln: for each bucket, torch.export the same
sharded model and `aoti_compile_and_package` it with the same Inductor options
(`kiln.host.compile.compiler.compile_forward` is exactly that, so both sides compile
identical graphs). No pool, no store, no Prefect. The JSON holds the seconds
spent importing and compiling, measured inside the process.
"""

from __future__ import annotations

import time

_START = time.perf_counter()

import argparse  # noqa: E402
import json  # noqa: E402
from pathlib import Path  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.loop")
    p.add_argument("--model", required=True)
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--buckets", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--json", required=True)
    args = p.parse_args(argv)

    from kiln.host.compile import inductor_cache

    inductor_cache.use(inductor_cache.prepare())  # the private caches the pool's workers use, before torch
    import torch

    from kiln.core.forwards.forward_keys import forward_spec
    from kiln.core.plan.recipe import Recipe, parse_buckets
    from kiln.host.weights.checkpoint import inspect_checkpoint
    from kiln.host.compile.compiler import compile_forward
    from kiln.host.compile.key_sources import model_code_fingerprint
    from kiln.host.compile.inductor_options import COMPILER_OPTIONS, inductor_env
    from kiln.host.machine.probe import detect_target

    imported = time.perf_counter()
    cfg = inspect_checkpoint(args.model)
    recipe = Recipe(buckets=parse_buckets(args.buckets), shape_policy="static")  # as the bench's exports
    # The graph, target and options an export's probe keys its forwards with (kiln.host.phases.host_probe.probe_host).
    graph = {"config": cfg.__dict__.copy(), "tp": args.tp, "code": model_code_fingerprint(),
             "inductor_env": inductor_env()}
    host_target = detect_target("cpu")
    target = host_target.fingerprint
    per_forward, keys = {}, []
    for shapes in recipe.shapes:
        spec = forward_spec(shapes=shapes, graph=graph, target=target, torch_version=torch.__version__,
                            page_tokens=recipe.page_tokens, pages_per_seq=recipe.pages_per_seq,
                            compiler={**COMPILER_OPTIONS, **host_target.inductor_options}).to_dict()
        result = compile_forward(spec, str(Path(args.out) / f"{spec['key']}.pt2"))
        per_forward[str(shapes)] = result.compile_s
        keys.append(spec["key"])
    done = time.perf_counter()
    Path(args.json).write_text(json.dumps({
        "import_s": imported - _START, "compile_s": done - imported, "per_forward_compile_s": per_forward,
        "in_process_s": done - _START, "keys": sorted(keys)}, indent=2))


if __name__ == "__main__":
    main()
