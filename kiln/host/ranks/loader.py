"""Load compiled forwards safely and check them against eager.

A compiled package is native code. The loader copies the file into a private
directory while hashing it and only ever opens that copy, so the bytes loaded
are the bytes hashed (nobody can swap the file between the check and the
load); it opens the copy only when its sha256 matches the manifest and whose zip members pass kiln.host.trust.package_check (no
absolute or '..' paths, no symlinks, bounded sizes, a PT2 layout) before
AOTInductor extracts it, checks the rank's weights against the dtype and shape
of every constant the package records (naming the tensor that does not fit),
always supplies them (`load_constants(..., check_full_update=True)`) before the
first call (calling first would crash the process), refuses a package that
needs constants no rank's weights provide, and turns on
AOTInductor's runtime input checks so a wrong shape raises instead of
returning garbage.

One copy of a rank's weights: every package of the rank is handed the same
tensors with `load_constants(..., user_managed=True)` where the installed torch
takes it (2.13 does), on the CPU as on a GPU, so a rank holds its weights once
however many buckets it loads (an older torch copies them into each package).
The package keeps pointers to them, not references: the loader keeps the
tensors alive on the returned package (`kiln_weights`). On a GPU (`device`
'cuda' or 'cuda:N': what the caller asks for, never guessed) the package must
have been compiled for CUDA and the rank's weights must already lie on that GPU
(`place_weights`, once per rank).
"""

from __future__ import annotations

import hashlib
import inspect
import json
import os
import tempfile
from pathlib import Path

from kiln.core.errors import IntegrityError, KilnError, UnloadablePackage
from kiln.host.trust.package_check import check_package, package_device

LOADER_PRELOAD = ["torch", "torch.distributed", "torch._inductor.package", "torch._inductor.codecache",
                  "kiln.host.model", "kiln.host.weights.rank_weights", "kiln.host.ranks.loader"]
"""What a process that loads packages imports before it loads any (aoti_load_package's modules, the eager model,
the weights' readers): its forkserver (kiln.host.compile.worker_start.acquire) imports them once."""


def load_forward(path: Path | str, weights: dict, sha256: str, *, device: str = "cpu"):
    """Verify (sha256, then package members), load and bind weights; return the callable forward, which
    runs on `device` ('cpu', 'cuda' or 'cuda:N'; its inputs must lie there).

    What is verified and loaded is a private copy made while hashing (mode 0600 in a 0700 directory,
    removed once AOTInductor has extracted it), never `path` itself. On a GPU the weights must already be
    on `device` (place_weights). The weights are bound without a copy where torch allows it (see the
    module): hand every package of a rank the same `weights` (place_weights' result) and never change them.
    """
    os.environ["AOTI_RUNTIME_CHECK_INPUTS"] = "1"
    import torch

    want = torch.device(device)

    from kiln.host.processes.scratch import own_dir

    # In this process's own temporary directory: swept at the next start if this process is killed meanwhile.
    with tempfile.TemporaryDirectory(prefix="kiln-load-", dir=own_dir()) as private:
        copy = Path(private) / Path(path).name
        got = _copy_hashing(path, copy)
        if got != sha256:
            raise IntegrityError(f"{path}: sha256 {got[:12]}… does not match the manifest's {sha256[:12]}…; "
                                 "refusing to load it. Delete the local copy and re-run to fetch it again.")
        check_package(copy)  # before AOTInductor extracts anything
        check_made_for(Path(path).name, package_device(copy), want)  # before a CUDA package meets a CPU torch
        compiled = _load_package(torch, copy, want)
    check_device(Path(path).name, compiled, weights, want)
    check_weights(Path(path).name, compiled, weights)
    names = set(compiled.get_constant_fqns())
    constants = {n: _compact(t) for n, t in weights.items() if n in names}
    shared = "user_managed" in load_constants_params(compiled)
    if shared:
        compiled.load_constants(constants, check_full_update=True, user_managed=True)
        compiled.kiln_weights = constants  # the package keeps pointers to them, not references
    else:  # an older torch: the package copies them (one more copy per package)
        compiled.load_constants(constants, check_full_update=True)
    compiled.kiln_user_managed = shared
    return compiled


def _load_package(torch, copy: Path, want):
    """aoti_load_package on `want`'s GPU index, where this torch takes one (2.13 does: `device_index`)."""
    kwargs = {}
    if want.type == "cuda" and "device_index" in inspect.signature(torch._inductor.aoti_load_package).parameters:
        kwargs["device_index"] = want.index if want.index is not None else torch.cuda.current_device()
    return torch._inductor.aoti_load_package(str(copy), **kwargs)


def load_constants_params(compiled) -> list[str]:
    """The parameters of this torch's AOTICompiledModel.load_constants (e.g. 'user_managed', 2.13)."""
    return [p for p in inspect.signature(compiled.load_constants).parameters]


def place_weights(weights: dict, device: str) -> dict:
    """The rank's weights on `device`, each a compact tensor of its own (load_constants needs that), moved
    once: hand the result to every load_forward of the rank, which then binds these very tensors. On the
    CPU, `weights` itself when every tensor is already compact (what the checkpoint loaders return)."""
    import torch

    if torch.device(device).type == "cpu":
        compact = {name: _compact(t) for name, t in weights.items()}
        return weights if all(compact[n] is weights[n] for n in weights) else compact
    return {name: _compact(t.to(device)) for name, t in weights.items()}


def check_made_for(package: str, made_for: str | None, want) -> None:
    """Refuse, by name, a package compiled for another device (`made_for`; None: not recorded) than `want`."""
    if made_for is not None and made_for != want.type:
        raise UnloadablePackage(f"{package} was compiled for {made_for}, but it was asked to run on {want}; "
                                f"load it on a {made_for} device, or export for {want.type}.")


def check_device(package: str, compiled, weights: dict, want) -> None:
    """Refuse, by name, a loaded package compiled for another device than `want`, or weights not on it."""
    check_made_for(package, compiled.get_metadata().get("AOTI_DEVICE_KEY"), want)
    names = set(compiled.get_constant_fqns())
    for name in sorted(names & set(weights)):
        got = weights[name].device
        if got.type != want.type or (want.index is not None and got.index not in (None, want.index)):
            raise UnloadablePackage(f"{package}: weight {name} is on {got}, but the forward runs on {want}; "
                                    "place the rank's weights there once (kiln.host.ranks.loader.place_weights) and "
                                    "hand them to every package.")


def _copy_hashing(src: Path | str, dest: Path) -> str:
    """Copy `src` to the new file `dest` (0600) and return the sha256 of the bytes written."""
    h = hashlib.sha256()
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with open(src, "rb") as f, os.fdopen(fd, "wb") as out:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
            out.write(chunk)
    return h.hexdigest()


def check_weights(package: str, compiled, weights: dict) -> None:
    """Refuse weights that the package was not compiled for, naming the tensor; before any is loaded.

    `load_constants` accepts a tensor of another dtype and computes garbage
    with it; a constant no rank's weights provide would crash the first call.
    """
    from kiln.host.compile.export_call import CONSTANTS_METADATA

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


def judge(got, eager, exact=None, reference=None, *, atol: float, half_ratio: float) -> dict:
    """{'diff', 'own', 'limit'} of compiled outputs `got` (logits and new cache entries) against eager's.

    float32 (`exact` None): diff is the scaled difference from `reference`
    (eager forced to the forward's own choices; `eager` where None), limit
    `atol`. bfloat16/float16: `exact` is eager in float32 on the same weights
    forced to `eager`'s choices: `own` is eager's scaled difference from it
    (rounding alone), and the limit is `half_ratio` times that (at least
    `atol`): the compiled forward may not be much worse than the dtype itself
    makes the reference implementation. diff is the scaled difference from
    `reference`, float32 forced to the checked forward's choices
    (kiln.host.ranks.routing_ties).
    """
    reference = eager if reference is None else reference
    diff = max(scaled_diff(g, r) for g, r in zip(got, reference))
    if exact is None:
        return {"diff": diff, "own": None, "limit": atol}
    own = max(scaled_diff(e, x) for e, x in zip(eager, exact))
    return {"diff": diff, "own": own, "limit": limit_of(own, atol=atol, half_ratio=half_ratio)}


def limit_of(own: float | None, *, atol: float, half_ratio: float) -> float:
    """The limit of a check whose eager reference has error `own` in its dtype (None: float32)."""
    return atol if own is None else max(atol, half_ratio * own)


def eager_model(cfg, tp: int, weights: dict, *, device: str = "cpu", rank: int = 0):
    """The eager shard of rank `rank` of `cfg` (layers unrolled; its share: kiln.core.model.shares) in cfg.dtype
    on `device`, holding `weights`.

    Built without storage, then each weight copied in (converted as it goes): one copy of the shard in
    cfg.dtype, never a second one in a converted state dict."""
    import torch

    from kiln.host.model import decoder_of

    with torch.device("meta"):
        model = decoder_of(cfg, tp, scan=False, rank=rank).to(getattr(torch, cfg.dtype)).eval()
    model = model.to_empty(device=device)
    params = model.state_dict()
    if set(params) != set(weights):
        raise KilnError(f"the rank's weights do not match the model: {sorted(set(params) ^ set(weights))[:3]}")
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name])
    return model


def eager_outputs(cfg, tp: int, weights: dict, args, *, device: str = "cpu",
                  rank: int = 0) -> tuple[tuple, tuple | None]:
    """(outputs of the eager shard in cfg.dtype, and in float32 on the same weights when cfg.dtype is lower),
    computed on `device` (the weights and `args` may lie anywhere: they are copied there)."""
    import torch

    def run(dtype: str):
        model = eager_model(cfg.replace(dtype=dtype), tp, weights, device=device, rank=rank)
        with torch.no_grad():
            cast = tuple((a.to(getattr(torch, dtype)) if a.is_floating_point() else a).to(device) for a in args)
            return model(*cast)

    return run(cfg.dtype), (None if cfg.dtype == "float32" else run("float32"))


def _eager_model(cfg, tp: int, weights: dict, dtype: str, device: str = "cpu", rank: int = 0):
    return eager_model(cfg.replace(dtype=dtype), tp, weights, device=device, rank=rank)


def check_against_eager(got, cfg, tp: int, weights: dict, args, *, atol: float, half_ratio: float,
                        device: str = "cpu", rank: int = 0) -> dict:
    """judge's {'diff', 'own', 'limit'} of a forward's outputs `got` against the eager shard on `args`, with
    'choices' (the forward's discrete choices checked: rows over every choice layer), 'differ' (how many of
    them differ from float32's own) and 'wrong_choice' (None, or the worst choice the dtype does not allow:
    kiln.host.ranks.routing_ties.wrong_choices' first).

    The float32 reference is forced to the forward's own choices (its outputs after new_kv,
    kiln.core.model.interface.choice_sites); in a low dtype the limit comes from eager's error against
    float32 forced to eager's own choices. One eager model is alive at a time (the low-dtype one, then the
    float32 one, run once per forcing).
    """
    import torch

    from kiln.core.model.interface import choice_sites
    from kiln.host.ranks.routing_ties import (ChoiceProbe, differing, forced_by, probing, rounding, scale_rounding,
                                              wrong_choices)

    def cast(dtype):
        return tuple((a.to(getattr(torch, dtype)) if a.is_floating_point() else a).to(device) for a in args)

    sites = choice_sites(cfg)
    got = tuple(g.to(device) for g in got)
    if len(got) != 2 + len(sites):
        raise KilnError(f"the forward returned {len(got)} outputs; this model's forward returns "
                        f"{2 + len(sites)} (logits, new_kv{''.join(', ' + s for s in sites)}): it was compiled "
                        "by an older Kiln; export it again.")
    outputs, picks = got[:2], forced_by(sites, got[2:])
    with torch.no_grad():
        exact = None
        if cfg.dtype == "float32":
            model = _eager_model(cfg, tp, weights, "float32", device, rank)
            with probing(ChoiceProbe(picks)) as forced:
                reference = model(*cast("float32"))[:2]
            eager, slack = reference, scale_rounding(forced, atol)
        else:
            with probing(ChoiceProbe()) as low:
                eager = _eager_model(cfg, tp, weights, cfg.dtype, device, rank)(*cast(cfg.dtype))[:2]
            model = _eager_model(cfg, tp, weights, "float32", device, rank)
            exact_args = cast("float32")
            with probing(ChoiceProbe(low.chosen)) as own:
                exact = model(*exact_args)[:2]
            with probing(ChoiceProbe(picks)) as forced:
                reference = model(*exact_args)[:2]
            slack = {s: [(1 + half_ratio) * r for r in rs] for s, rs in rounding(low, own).items()}
        result = judge(outputs, eager, exact, reference, atol=atol, half_ratio=half_ratio)
        wrong = wrong_choices(forced, slack)
    rows = sum(c.shape[0] for chosen in forced.chosen.values() for c in chosen)
    return {**result, "choices": rows, "differ": differing(forced),
            "wrong_choice": describe_choice(cfg, wrong[0]) if wrong else None}


def describe_choice(cfg, wrong: dict) -> str:
    """A sentence naming a choice the dtype does not allow (kiln.host.ranks.routing_ties.wrong_choices' entry)."""
    from kiln.core.model.interface import choice_layers

    layers = choice_layers(cfg, wrong["site"])
    what = "experts" if wrong["site"] == "experts" else "indexer picks"
    if wrong.get("misfit"):
        return (f"its {what} output has shape {wrong['got']} at the {wrong['layer'] + 1}-th layer that makes them "
                f"(of {len(layers)}), but this model makes {wrong['picks']} per token there")
    layer = layers[wrong["layer"]]
    return (f"layer {layer}'s {what} {wrong['picks']} at row {wrong['row']} trail the best float32 choice by "
            f"{wrong['behind']:.3g} in score, more than the dtype's slack {wrong['slack']:.3g} "
            f"({wrong['count']} such row(s) in that layer)")


def compare_with_eager(compiled, cfg, tp: int, rank: int, weights: dict, bucket, *, page_tokens: int,
                       pages_per_seq: int, atol: float, half_ratio: float, seed: int = 1,
                       device: str = "cpu") -> dict:
    """{'diff', 'own', 'limit', ...} of the compiled forward against the eager shard (check_against_eager),
    both on `device` (where `compiled` was loaded)."""
    import torch

    from kiln.host.model import example_inputs

    # A page count other than the one compiled with exercises the dynamic dimension.
    args = example_inputs(cfg, tp, bucket.batch, bucket.tokens, page_tokens=page_tokens,
                          pages_per_seq=pages_per_seq, num_pages=pages_per_seq * bucket.batch + 3, seed=seed,
                          rank=rank)
    args = tuple(a.to(device) for a in args)
    with torch.no_grad():
        got = compiled(*args)
    return check_against_eager(got, cfg, tp, weights, args, atol=atol, half_ratio=half_ratio, device=device,
                               rank=rank)


def compare_at_shapes(compiled, cfg, tp: int, rank: int, weights: dict, shapes, *, page_tokens: int,
                      pages_per_seq: int, atol: float, half_ratio: float, device: str = "cpu") -> dict:
    """The compiled forward over `shapes` (kiln.core.forwards.shape_ranges.ShapeRange) against the eager shard
    at each of its checked shapes (four corners, hint, an interior shape): the worst one's check
    (kiln.core.run.outcome.worst_shape)."""
    from kiln.core.run.outcome import worst_shape

    return worst_shape({str(c): compare_with_eager(compiled, cfg, tp, rank, weights, c, page_tokens=page_tokens,
                                                   pages_per_seq=pages_per_seq, atol=atol, half_ratio=half_ratio,
                                                   device=device)
                        for c in shapes.checked_shapes()})
