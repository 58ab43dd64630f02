"""Load compiled forwards safely and check them against eager.

A compiled package is native code. The loader only ever opens a file whose
sha256 matches the manifest and whose zip members pass kiln.package_check (no
absolute or '..' paths, no symlinks, bounded sizes, a PT2 layout) before
AOTInductor extracts it, always supplies and checks the rank's weights
(`load_constants(..., check_full_update=True)`) before the first call (calling
first would crash the process), refuses a package that needs constants no
rank's weights provide (weights baked in at compile time), and turns on
AOTInductor's runtime input checks so a wrong shape raises instead of
returning garbage.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from kiln.errors import IntegrityError, KilnError
from kiln.package_check import check_package


def sha256_of(path: Path | str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_forward(path: Path | str, weights: dict, sha256: str):
    """Verify (sha256, then package members), load and bind weights; return the callable forward."""
    got = sha256_of(path)
    if got != sha256:
        raise IntegrityError(f"{path}: sha256 {got[:12]}… does not match the manifest's {sha256[:12]}…; "
                             "refusing to load it. Delete the local copy and re-run to fetch it again.")
    check_package(path)  # before AOTInductor extracts anything
    os.environ["AOTI_RUNTIME_CHECK_INPUTS"] = "1"
    import torch

    import kiln.model  # noqa: F401  registers kiln::all_reduce, which the package calls

    compiled = torch._inductor.aoti_load_package(str(path))
    names = set(compiled.get_constant_fqns())
    baked = sorted(names - set(weights))
    if baked:
        raise KilnError(f"{Path(path).name} needs {len(baked)} constant(s) that no rank's weights provide "
                        f"({', '.join(baked[:3])}, ...): it was compiled with kernels that bake weights in "
                        "(CPU max-autotune's C++ GEMM templates prepack them), so no rank can load it.")
    compiled.load_constants({n: _compact(t) for n, t in weights.items() if n in names}, check_full_update=True)
    return compiled


def _compact(tensor):
    """A tensor that owns exactly its bytes: load_constants crashes on views into larger storage."""
    tensor = tensor.contiguous()
    if tensor.storage_offset() or tensor.untyped_storage().nbytes() != tensor.nbytes:
        tensor = tensor.clone()
    return tensor


def compare_with_eager(compiled, cfg, tp: int, rank: int, weights: dict, bucket, *, page_tokens: int,
                       pages_per_seq: int, seed: int = 1) -> float:
    """Largest absolute difference between the compiled forward and the eager shard."""
    import torch

    from kiln.model import ShardedDecoder, example_inputs

    eager = ShardedDecoder(cfg, tp).eval()
    eager.load_state_dict(weights, strict=True)
    # A page count other than the one compiled with exercises the dynamic dimension.
    args = example_inputs(cfg, tp, bucket.batch, bucket.tokens, page_tokens=page_tokens,
                          pages_per_seq=pages_per_seq, num_pages=pages_per_seq * bucket.batch + 3, seed=seed)
    with torch.no_grad():
        got = compiled(*args)
        want = eager(*args)
    return max(float((g - w).abs().max()) for g, w in zip(got, want))
