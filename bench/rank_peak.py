"""One rank's memory with several packages loaded: one copy of its weights however many buckets it holds.

`python -m bench.rank_peak compile OUT_DIR [QUICK]` writes a random checkpoint of `config()` (float32) to
OUT_DIR/ckpt and compiles its 1x8 forward (tp 1) to OUT_DIR/forward.pt2 (run it in a fresh process with a
fresh Inductor cache).

`python -m bench.rank_peak measure OUT_DIR PACKAGES [QUICK]` then, in a fresh process, does what a rank of
`kiln run` and of the export's rank check do, measuring the process's peak resident memory (VmHWM) against
what it held before the weights were read:
- run: read the rank's weights (kiln.host.weights.checkpoint.load_rank_weights), load PACKAGES packages with them
  (the same file each time: the memory of a package does not depend on its bucket beyond its code) and take
  one step of each;
- check: then compare each with the eager shard (kiln.host.ranks.loader.compare_with_eager), as the rank check does.
It prints {'weight_bytes', 'base_bytes', 'run_peak_bytes', 'check_peak_bytes', 'package_bytes',
'predicted_check_mib'}: base is the process's resident memory before the weights (torch imported, the
process group joined), package_bytes what the packages added after the weights (the runtime's fixed cost, all
of them), predicted_check_mib kiln.core.plan.sizing.check_peak_mib with the measured base.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

PACKAGES = 6
BUCKET = (1, 8)
PAGE_TOKENS, PAGES_PER_SEQ = 16, 4


def config(quick: bool):
    """A Llama of real proportions whose weights dwarf the runtime (~300 MB in float32; ~100 MB quick)."""
    from kiln.core.model.config import TINY

    return TINY.replace(hidden_size=768, num_heads=12, num_kv_heads=4, head_dim=64, intermediate_size=2048,
                        num_layers=2 if quick else 4, vocab_size=16000 if quick else 32000)


def compile_one(out: Path, quick: bool) -> dict:
    from bench.specs import bench_spec
    from kiln.host.weights.checkpoint import random_checkpoint
    from kiln.host.compile.compiler import _warm, compile_forward

    cfg = config(quick)
    random_checkpoint(out / "ckpt", cfg, seed=5)
    _warm()
    spec = bench_spec(cfg, tp=1, bucket=BUCKET, page_tokens=PAGE_TOKENS, pages_per_seq=PAGES_PER_SEQ)
    result = compile_forward(spec, str(out / "forward.pt2"))
    return {"compile_s": result.compile_s, "size_bytes": result.size_bytes}


def measure(out: Path, num_packages: int, quick: bool) -> dict:
    import torch

    from bench.loader_peak import _reset_peak, _status_bytes
    from kiln.core.plan.recipe import Bucket
    from kiln.core.model.rank_bytes import weight_bytes_per_rank
    from kiln.core.plan.sizing import check_peak_mib
    from kiln.host.weights.checkpoint import load_rank_weights
    from kiln.host.ranks.loader import compare_with_eager, load_forward
    from kiln.store import sha256_file
    from kiln.host.model import example_inputs, solo_group

    cfg = config(quick)
    path = out / "forward.pt2"
    sha = sha256_file(path)
    with solo_group(), torch.no_grad():
        _reset_peak()
        base = _status_bytes("VmRSS")
        weights = load_rank_weights(out / "ckpt", cfg, 1, 0)
        with_weights = _status_bytes("VmRSS")
        packages = [load_forward(path, weights, sha) for _ in range(num_packages)]
        package_bytes = _status_bytes("VmRSS") - with_weights
        args = example_inputs(cfg, 1, *BUCKET, page_tokens=PAGE_TOKENS, pages_per_seq=PAGES_PER_SEQ,
                              num_pages=PAGES_PER_SEQ + 1)
        for package in packages:
            package(*args)
        run_peak = _status_bytes("VmHWM") - base
        for package in packages:
            compare_with_eager(package, cfg, 1, 0, weights, Bucket(*BUCKET), page_tokens=PAGE_TOKENS,
                               pages_per_seq=PAGES_PER_SEQ, atol=1e-3, half_ratio=2.0)
        check_peak = _status_bytes("VmHWM") - base
    weight_bytes = sum(t.nbytes for t in weights.values())
    return {"weight_bytes": weight_bytes, "base_bytes": base, "run_peak_bytes": run_peak,
            "check_peak_bytes": check_peak, "package_bytes": package_bytes,
            "predicted_check_mib": check_peak_mib(shard_bytes=weight_bytes_per_rank(cfg, 1), num_forwards=num_packages,
                                                  half=False, process_base_mib=base // 2**20)}


if __name__ == "__main__":
    quick = sys.argv[-1] == "quick"
    out = Path(sys.argv[2])
    if sys.argv[1] == "compile":
        out.mkdir(parents=True, exist_ok=True)
        (out / "compile.json").write_text(json.dumps(compile_one(out, quick)))
    else:
        print(json.dumps(measure(out, int(sys.argv[3]), quick)))
