"""Kernel tuning: which GEMM shapes an export needs, where their results live, and what to measure.

Pure: no torch, prefect or boto3 import. The side effects (measuring in a
spawned process, the store, Inductor's cache) live in `kiln.host.compile.tuner`.

The unit of tuning is one GEMM shape (M, K, N, dtype) on one target with one
torch version: Inductor's max-autotune benchmarks every candidate kernel for
it (on CPU: ATen `mm` against C++ micro-GEMM templates) and keeps the timings
in its autotune cache as

    entries[op][inputs_key][precision][choice_hash] = milliseconds

A *result* is one shape's entries plus what they are for. Results are stored
create-once at `tuning/<result_id>/<signer>.json` where `result_id` hashes the
format, target fingerprint, torch version and shape, as a record signed by the
export that measured it (kiln.core.trust.signed_record, kind 'tuning'); mode
`full` replaces the signer's own. A result picks kernels, so one is applied only
when a key the export trusts signed it, and only when its embedded target,
torch version and shape are the ones asked for (`check_result`), never for
another target or torch. An unsigned export tunes nothing: no export could
trust what it measured.

A forward's key holds `tuning_digest` of its shapes' results: a digest of the
*winning* choice per GEMM (what Inductor compiles), not of the raw timings.
So `cached` and `full` give the same key when re-measuring picks the same
kernels, and a different key (a recompile) when it picks others.

Which candidates a forward may use: Kiln's forwards are weightless (every
rank loads its own weights at run time), so only GEMM kernels that read the
weight as a run-time constant qualify (`WEIGHTLESS_GEMM_BACKENDS`). On CPU,
Inductor's C++ GEMM templates (its only alternative to ATen `mm` without
freezing, which bakes weights in by design) prepack the weight at compile
time into new constants: a weightless package compiled with them asks for
packed copies of the placeholder weights that no rank can supply. That leaves ATen alone on CPU, nothing to choose between, and
the tune phase says so instead of measuring (`gemm_backends`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from kiln.core.model.config import ModelConfig
from kiln.core.model.shares import rank_share
from kiln.core.errors import IntegrityError
from kiln.core.forwards.forward_keys import digest
from kiln.core.trust.layout import tuning_key, tuning_prefix
from kiln.core.plan.recipe import TUNING_MODES, Bucket
from kiln.core.forwards.shape_ranges import ShapeRange

FORMAT = 1
"""Version of the stored result layout; part of every result id."""

WEIGHTLESS_GEMM_BACKENDS: dict[str, tuple[str, ...]] = {"cpu": ("ATEN",)}
"""Forward device -> Inductor GEMM backends whose kernels take the weight as a run-time constant.

Only what was verified: on CPU with torch 2.13 the C++ templates ('CPP')
prepack weights at compile time (tests/tuning/test_tuning_compile.py keeps
checking that). Devices not listed are not tuned until verified.
"""


class TuningMismatch(IntegrityError):
    """A stored tuning result is for another target, torch version or shape, or is malformed."""


@dataclass(frozen=True, order=True)
class GemmShape:
    """One matrix multiply: (m x k) @ (k x n) in `dtype` (a torch dtype name such as 'float32')."""

    m: int
    k: int
    n: int
    dtype: str

    def __str__(self) -> str:
        return f"{self.m}x{self.k}x{self.n}:{self.dtype}"

    def to_dict(self) -> dict:
        return {"m": self.m, "k": self.k, "n": self.n, "dtype": self.dtype}

    @classmethod
    def from_dict(cls, raw: dict) -> "GemmShape":
        return cls(int(raw["m"]), int(raw["k"]), int(raw["n"]), str(raw["dtype"]))


def bucket_shapes(cfg: ModelConfig, tp: int, bucket: Bucket) -> tuple[GemmShape, ...]:
    """Distinct GEMM shapes of one rank's forward for `bucket`, sorted.

    Every projection of kiln.host.model is a bias-free linear on (batch*tokens)
    rows: q, k, v, o, gate, up, down (sharded by tp) and the replicated
    lm_head. tests/unit/test_tuning_logic.py checks this list against the
    exported graph, so a model change that adds a GEMM fails a test.
    """
    h, hd = cfg.hidden_size, cfg.head_dim
    share = rank_share(cfg, tp, 0).counts()  # rank 0's: where tp splits unevenly, the largest GEMMs
    q, kv, mlp = share["heads"] * hd, share["kv_heads"] * hd, share["mlp"]
    m = bucket.batch * bucket.tokens
    pairs = {(h, q), (h, kv), (q, h), (h, mlp), (mlp, h), (h, cfg.vocab_size)}
    return tuple(sorted(GemmShape(m, k, n, cfg.dtype) for k, n in pairs))


def export_shapes(cfg: ModelConfig, tp: int, forwards: tuple[ShapeRange, ...]) -> dict[str, tuple[GemmShape, ...]]:
    """Forward shapes' name -> the GEMM shapes of its hint (the shape Inductor tunes a range's kernels for).
    Hints with equal batch*tokens share shapes."""
    return {str(r): bucket_shapes(cfg, tp, r.hint) for r in forwards}


def distinct_shapes(by_bucket: dict[str, tuple[GemmShape, ...]]) -> tuple[GemmShape, ...]:
    return tuple(sorted({s for shapes in by_bucket.values() for s in shapes}))


def gemm_backends(mode: str, device: str) -> str | None:
    """The GEMM backends forwards on `device` autotune over ('ATEN,TRITON'), or None: no tuning.

    None when the mode is 'off' or when `device` offers weightless forwards
    fewer than two backends to choose between (then the forward compiles as
    with tuning off, and gets the same key).
    """
    if mode not in TUNING_MODES:
        raise ValueError(f"unknown tuning mode {mode!r}")
    usable = WEIGHTLESS_GEMM_BACKENDS.get(device, ())
    return ",".join(usable) if mode != "off" and len(usable) > 1 else None


def untuned_reason(mode: str, device: str) -> str:
    """Why `gemm_backends(mode, device)` is None, in one sentence for the report."""
    if mode == "off":
        return "tuning is off"
    usable = WEIGHTLESS_GEMM_BACKENDS.get(device)
    if usable is None:
        return f"kernel tuning of weightless forwards is not verified on {device} yet"
    return (f"on {device}, weightless forwards can use only {', '.join(usable)} GEMM kernels (Inductor's C++ "
            "templates prepack weights at compile time), so there is nothing to choose between")


def result_id(target: str, torch_version: str, backends: str, shape: GemmShape) -> str:
    """The id of one shape's result on `target` with `torch_version` over `backends` (32 hex characters)."""
    return digest({"format": FORMAT, "target": target, "torch": torch_version, "backends": backends,
                   "shape": shape.to_dict()})


def object_prefix(target: str, torch_version: str, backends: str, shape: GemmShape) -> str:
    """Where every signer's result of one shape lives (kiln.core.trust.layout.tuning_prefix)."""
    return tuning_prefix(result_id(target, torch_version, backends, shape))


def object_key(target: str, torch_version: str, backends: str, shape: GemmShape, signer: str) -> str:
    """Store key of one shape's result as the key with fingerprint `signer` measured and signed it
    (kiln.core.trust.layout.tuning_key)."""
    return tuning_key(result_id(target, torch_version, backends, shape), signer)


@dataclass(frozen=True)
class TuningDecision:
    """What the tune phase does for one target."""

    measure: tuple[GemmShape, ...]
    """Shapes to benchmark now."""
    hits: tuple[GemmShape, ...]
    """Shapes whose stored results are used as they are."""
    replace: bool
    """Whether new results replace stored ones (mode 'full') instead of being created once."""


def decide(mode: str, wanted: tuple[GemmShape, ...], stored: set[GemmShape] | frozenset[GemmShape]) -> TuningDecision:
    """off: nothing; cached: measure the shapes not stored; full: measure every shape and replace."""
    if mode not in TUNING_MODES:
        raise ValueError(f"unknown tuning mode {mode!r}")
    wanted = tuple(sorted(set(wanted)))
    if mode == "off":
        return TuningDecision((), (), False)
    if mode == "full":
        return TuningDecision(wanted, (), True)
    return TuningDecision(tuple(s for s in wanted if s not in stored),
                          tuple(s for s in wanted if s in stored), False)


def build_result(*, target: str, torch_version: str, backends: str, shape: GemmShape, entries: dict,
                 measured_by: str, run: dict) -> dict:
    """The stored object of one shape. `run` describes the tuning run that measured it (seconds, counts)."""
    result = {"format": FORMAT, "target": target, "torch": torch_version, "backends": backends,
              "shape": shape.to_dict(), "entries": entries, "measured_by": measured_by, "run": run}
    check_result(result, target=target, torch_version=torch_version, backends=backends, shape=shape)
    return result


def check_result(result: dict, *, target: str, torch_version: str, backends: str,
                 shape: GemmShape | None = None, key: str = "tuning result") -> None:
    """Raise TuningMismatch unless `result` is a well-formed result for exactly this target, torch,
    backends and (if given) shape."""
    if not isinstance(result, dict) or result.get("format") != FORMAT:
        raise TuningMismatch(f"{key} is not a Kiln tuning result of format {FORMAT}; delete it and tune again.")
    if result.get("target") != target or result.get("torch") != torch_version:
        raise TuningMismatch(
            f"{key} was measured on target {result.get('target')!r} with torch {result.get('torch')!r}, not "
            f"{target!r} with torch {torch_version!r}; it is never applied elsewhere.")
    if result.get("backends") != backends:
        raise TuningMismatch(f"{key} compares GEMM backends {result.get('backends')!r}, not {backends!r}.")
    if shape is not None and result.get("shape") != shape.to_dict():
        raise TuningMismatch(f"{key} holds shape {result.get('shape')}, not {shape}; delete it and tune again.")
    entries = result.get("entries")
    ok = isinstance(entries, dict) and entries and all(
        isinstance(ins, dict) and ins and all(
            isinstance(precs, dict) and precs and all(
                isinstance(choices, dict) and choices and all(
                    isinstance(c, str) and isinstance(t, (int, float)) and not isinstance(t, bool)
                    for c, t in choices.items())
                for choices in precs.values())
            for precs in ins.values())
        for ins in entries.values())
    if not ok:
        raise TuningMismatch(f"{key} has no usable entries (op -> inputs -> precision -> choice -> ms).")


def merge_entries(results: list[dict]) -> dict:
    """Union of the results' entries; a later result's timing wins for the same choice."""
    out: dict = {}
    for r in results:
        for op, ins in r["entries"].items():
            for inputs, precs in ins.items():
                for precision, choices in precs.items():
                    out.setdefault(op, {}).setdefault(inputs, {}).setdefault(precision, {}).update(choices)
    return out


def count_timings(entries: dict) -> int:
    """Number of (op, inputs, precision, choice) timings: candidates that were benchmarked to produce them."""
    return sum(len(c) for ins in entries.values() for precs in ins.values() for c in precs.values())


def winners(entries: dict) -> dict:
    """op -> inputs -> precision -> the fastest choice, as Inductor picks it (lowest finite time).

    Exact ties are broken by choice name here and by candidate order in
    Inductor; only identical timings can make the two differ.
    """
    out: dict = {}
    for op, ins in entries.items():
        for inputs, precs in ins.items():
            for precision, choices in precs.items():
                finite = {c: t for c, t in choices.items() if math.isfinite(t)}
                if finite:
                    best = min(finite, key=lambda c: (finite[c], c))
                    out.setdefault(op, {}).setdefault(inputs, {})[precision] = best
    return out


def tuning_digest(results: list[dict]) -> str:
    """Digest of the decisions `results` make: their shapes and the winning kernel of each GEMM."""
    shapes = sorted({str(GemmShape.from_dict(r["shape"])) for r in results})
    return digest({"format": FORMAT, "shapes": shapes, "winners": winners(merge_entries(results))})


def tuning_hosts(probes: list) -> dict[str, str]:
    """target -> the one host that tunes it: the first by name among that target's hosts.

    Tuning runs once per distinct target; the other hosts of the target load
    its results from the store.
    """
    out: dict[str, str] = {}
    for p in sorted(probes, key=lambda p: p.name):
        out.setdefault(p.target, p.name)
    return out


def summarize(runs: list[dict]) -> dict:
    """The tune phase's report entry from every target's run: status, counts, seconds, why skipped."""
    status = "skipped" if all(r["status"] == "skipped" for r in runs) else "ok"
    out = {"status": status, "measured": sum(r["measured"] for r in runs),
           "hits": sum(r["hits"] for r in runs), "misses": sum(r["misses"] for r in runs),
           "measure_s": round(sum(r["measure_s"] for r in runs), 3),
           "runs": [{k: r.get(k) for k in ("target", "mode", "status", "backends", "shapes", "measured", "hits",
                                            "misses", "measure_s", "reason")} for r in runs]}
    reasons = sorted({r["reason"] for r in runs if r.get("reason")})
    if reasons:
        out["reason"] = "; ".join(reasons)
    return out
