"""Load compiled forwards safely and check them against eager.

A compiled package is native code. The loader only ever opens a file whose
sha256 matches the manifest and whose zip members pass kiln.core.package_check (no
absolute or '..' paths, no symlinks, bounded sizes, a PT2 layout) before
AOTInductor extracts it, checks the rank's weights against the dtype and shape
of every constant the package records (naming the tensor that does not fit),
always supplies them (`load_constants(..., check_full_update=True)`) before the
first call (calling first would crash the process), refuses a package that
needs constants no rank's weights provide, and turns on
AOTInductor's runtime input checks so a wrong shape raises instead of
returning garbage.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

from kiln.core.errors import IntegrityError, KilnError, UnloadablePackage
from kiln.core.package_check import check_package


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

    compiled = torch._inductor.aoti_load_package(str(path))
    check_weights(Path(path).name, compiled, weights)
    names = set(compiled.get_constant_fqns())
    compiled.load_constants({n: _compact(t) for n, t in weights.items() if n in names}, check_full_update=True)
    return compiled


def check_weights(package: str, compiled, weights: dict) -> None:
    """Refuse weights that the package was not compiled for, naming the tensor; before any is loaded.

    `load_constants` accepts a tensor of another dtype and computes garbage
    with it; a constant no rank's weights provide would crash the first call.
    """
    from kiln.host.compiler import CONSTANTS_METADATA

    raw = compiled.get_metadata().get(CONSTANTS_METADATA)
    if raw is None:
        raise UnloadablePackage(f"{package} does not record the weights it was compiled for (made by an older "
                                "Kiln?); export it again.")
    expected = json.loads(raw)
    names = set(compiled.get_constant_fqns())
    unprovided = sorted(names - set(weights))
    if unprovided:
        made = [n for n in unprovided if n not in expected]
        buffers = [n for n in unprovided if n in expected and expected[n][2:] == ["buffer"]]
        if made:
            cause = (f"{len(made)} of them ({', '.join(made[:3])}) are not tensors of the exported module but "
                     "constants the compiler made: weights prepacked by CPU max-autotune's C++ GEMM templates, "
                     "which bake weights in; compile without them")
        elif buffers:
            cause = (f"the module's buffers {', '.join(buffers[:3])} became package constants; the model must "
                     "compute them in the graph")
        else:
            cause = "the rank's weights lack them: the checkpoint does not match the export"
        raise UnloadablePackage(f"{package} needs {len(unprovided)} constant(s) that no rank's weights provide "
                                f"({', '.join(unprovided[:3])}): {cause}.")
    for name in sorted(names):
        dtype, shape = expected.get(name, (None, None))[:2]
        tensor = weights[name]
        got_dtype = str(tensor.dtype).removeprefix("torch.")
        if dtype is not None and (got_dtype != dtype or list(tensor.shape) != shape):
            raise UnloadablePackage(f"{package}: weight {name} is {got_dtype} {list(tensor.shape)} but the package "
                                    f"was compiled for {dtype} {shape}; refusing to load it (no silent cast). "
                                    "Export again with the checkpoint's dtype, or pass the matching --dtype.")


def _compact(tensor):
    """A tensor that owns exactly its bytes: load_constants crashes on views into larger storage."""
    tensor = tensor.contiguous()
    if tensor.storage_offset() or tensor.untyped_storage().nbytes() != tensor.nbytes:
        tensor = tensor.clone()
    return tensor


def scaled_diff(got, want) -> float:
    """max |got - want| / max(1, max |want|): absolute for small outputs, relative for large ones."""
    return float((got.float() - want.float()).abs().max()) / max(1.0, float(want.float().abs().max()))


def judge(got, eager, exact=None, alternatives=(), *, atol: float, half_ratio: float) -> dict:
    """{'diff', 'own', 'limit'} of compiled outputs `got` (a tuple of tensors) against the eager model's.

    float32 (`exact` None): diff is the scaled difference from `eager`, limit
    `atol`. bfloat16/float16: `exact` is eager in float32 on the same weights,
    routed as `eager` was (kiln.host.routing_ties); `own` is eager's scaled
    difference from it, and the limit is `half_ratio` times that (at least
    `atol`): the compiled forward may not be much worse than the dtype itself
    makes the reference implementation. diff is, per output position
    (sequence, token), the scaled difference from the nearest of `exact` and
    `alternatives` (float32 references that take the routing choices the
    dtype leaves open), the largest over the positions; each output is
    scaled by `exact`'s largest value.
    """
    import torch

    if exact is None:
        return {"diff": max(scaled_diff(g, e) for g, e in zip(got, eager)), "own": None, "limit": atol}
    own = max(scaled_diff(e, x) for e, x in zip(eager, exact))
    scales = [max(1.0, float(x.float().abs().max())) for x in exact]
    nearest = _position_diff(got, exact, scales)
    for alternative in alternatives:
        nearest = torch.minimum(nearest, _position_diff(got, alternative, scales))
    return {"diff": float(nearest.max()), "own": own, "limit": limit_of(own, atol=atol, half_ratio=half_ratio)}


def _position_diff(got, want, scales):
    """[batch, tokens]: per position, the largest scaled difference over the outputs."""
    import torch

    per = [_per_position((g.float() - w.float()).abs()) / s for g, w, s in zip(got, want, scales)]
    return functools.reduce(torch.maximum, per)


def _per_position(diff):
    """Logits [b, t, vocab] -> [b, t]; new cache entries [layers, entries, b, t, heads, width] -> [b, t]."""
    if diff.dim() == 3:
        return diff.amax(dim=-1)
    if diff.dim() == 6:
        return diff.amax(dim=(0, 1, 4, 5))
    raise KilnError(f"no token positions known for an output of shape {list(diff.shape)}")


def limit_of(own: float | None, *, atol: float, half_ratio: float) -> float:
    """The limit of a check whose eager reference has error `own` in its dtype (None: float32)."""
    return atol if own is None else max(atol, half_ratio * own)


def _eager_model(cfg, tp: int, weights: dict, dtype: str):
    """The eager shard in `dtype`, built without storage, then each weight copied in (converted as it goes):
    one copy of the shard in `dtype`, never a second one in a converted state dict."""
    import torch

    from kiln.host.model import ShardedDecoder

    with torch.device("meta"):
        model = ShardedDecoder(cfg.replace(dtype=dtype), tp, scan=False).to(getattr(torch, dtype)).eval()
    model = model.to_empty(device="cpu")
    params = model.state_dict()
    if set(params) != set(weights):
        raise KilnError(f"the rank's weights do not match the model: {sorted(set(params) ^ set(weights))[:3]}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name])
    return model


def check_against_eager(got, cfg, tp: int, weights: dict, args, *, atol: float, half_ratio: float) -> dict:
    """judge's {'diff', 'own', 'limit'} of outputs `got` against the eager shard on `args`, with 'ties' (the
    (layer, token) routing choices the low dtype leaves open) and 'routings' (float32 references run).

    In a low dtype the float32 references are routed as kiln.host.routing_ties says; one eager model is
    alive at a time (the low-dtype one, then the float32 one, run once per reference).
    """
    import torch

    from kiln.host.routing_ties import RouteProbe, find_ties, forced_as, probing, swapped_routings, tie_count

    def cast(dtype):
        return tuple(a.to(getattr(torch, dtype)) if a.is_floating_point() else a for a in args)

    with torch.no_grad():
        if cfg.dtype == "float32":
            return judge(got, _eager_model(cfg, tp, weights, "float32")(*args), atol=atol, half_ratio=half_ratio)
        with probing(RouteProbe()) as low:
            eager = _eager_model(cfg, tp, weights, cfg.dtype)(*cast(cfg.dtype))
        model = _eager_model(cfg, tp, weights, "float32")
        exact_args = cast("float32")
        with probing(RouteProbe(forced_as(low))) as forced:
            exact = model(*exact_args)
        ties = find_ties(low, forced, half_ratio=half_ratio)
        runs = [0]

        def alternatives():
            for routing in swapped_routings(low, ties):
                runs[0] += 1
                with probing(RouteProbe(routing)):
                    out = model(*exact_args)
                yield out  # outside the probe: a generator left unfinished must not leave it set

        result = judge(got, eager, exact, alternatives(), atol=atol, half_ratio=half_ratio)
    return {**result, "ties": tie_count(ties), "routings": 1 + runs[0]}


def compare_with_eager(compiled, cfg, tp: int, rank: int, weights: dict, bucket, *, page_tokens: int,
                       pages_per_seq: int, atol: float, half_ratio: float, seed: int = 1) -> dict:
    """{'diff', 'own', 'limit', ...} of the compiled forward against the eager shard (check_against_eager)."""
    import torch

    from kiln.host.model import example_inputs

    # A page count other than the one compiled with exercises the dynamic dimension.
    args = example_inputs(cfg, tp, bucket.batch, bucket.tokens, page_tokens=page_tokens,
                          pages_per_seq=pages_per_seq, num_pages=pages_per_seq * bucket.batch + 3, seed=seed)
    with torch.no_grad():
        got = compiled(*args)
    return check_against_eager(got, cfg, tp, weights, args, atol=atol, half_ratio=half_ratio)
