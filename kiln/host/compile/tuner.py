"""Kernel tuning with Inductor max-autotune: measure, store, look up, install.

Side effects only; the decisions (shapes, ids, what to measure, digests,
applicability) are in `kiln.core.plan.tuning_plan`.

- `tune_target(job, target)`: the tune phase for one target, on one host of
  that target. Looks up every GEMM shape's result in the store (verified),
  measures what the mode asks for in a *spawned* process (never a thread:
  Inductor is not thread-safe), stores each shape's result with its sha256.
  When weightless forwards have nothing to choose between on the forward
  device (CPU: see kiln.core.plan.tuning_plan), it measures nothing and says why.
- `lookup(...)`: per bucket, the stored results a forward is compiled with
  and their digest (for the forward's key); used by the probe.
- `load_for_compile(...)`: the verified union of the results a host's
  forwards need; `install(entries)` merges it into a compile worker's Inductor
  autotune cache, so Inductor finds every timing and benchmarks nothing.

How measuring works: one AOTInductor compile (max_autotune on, C++ sources
only) of a graph of bias-free linears, one per missing shape, in a fresh
Inductor cache directory. Its GEMMs produce the same autotune cache keys as
the forwards' (same op, input layouts and candidate kernels); the timings are
read back from that directory's autotune cache. Measured counts are Inductor's
own counters of benchmarked candidates, not autotune calls.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import time
from typing import TYPE_CHECKING

from kiln.core.plan import deadlines, tuning_plan
from kiln.core.plan.deadlines import Deadline
from kiln.core.errors import IntegrityError, KilnError
from kiln.core.forwards.forward_keys import ForwardSpec
from kiln.core.plan.tuning_plan import GemmShape
from kiln.core.machine.target import device_of
from kiln.host.machine import probe
from kiln.host.compile import inductor_cache
from kiln.host.compile.inductor_options import compiler_options
from kiln.host.processes.spawned import call_in_spawned
from kiln.store import ObjectMissing, Store, open_store, sha256_bytes

if TYPE_CHECKING:  # not at run time: kiln.core.plan.job brings kiln.core.trust.signing (cryptography) into every
    from kiln.core.plan.job import ExportJob  # compile worker, which imports this module to install tuning results


def benchmark_count() -> int:
    """Candidates Inductor benchmarked in this process so far (its CPU and GPU benchmark counters)."""
    from torch._dynamo.utils import counters

    return sum(v for k, v in counters["inductor"].items()
               if k.startswith("benchmarking.") and k.endswith((".benchmark_cpu", ".benchmark_gpu")))


def fetch_result(store: Store, target: str, torch_version: str, backends: str, shape: GemmShape,
                 trusted: dict) -> tuple[dict, str, str] | None:
    """The stored result of one shape that a key of `trusted` (fingerprint -> public key) signed, checked to
    be for this target, torch, backends and shape: (result, store key, sha256 of the stored bytes); None when
    no trusted signer's result is stored (an unsigned or untrusted one is never applied).

    TuningMismatch when a trusted signer's result is for something else.
    """
    from kiln.core.trust.signed_record import trusted_body

    prefix = tuning_plan.object_prefix(target, torch_version, backends, shape)
    for key in sorted(store.list(prefix)):
        try:
            data = store.get_bytes(key)  # bytes that are not what the store recorded raise IntegrityError
            result = trusted_body(json.loads(data), "tuning", trusted)
        except (ObjectMissing, ValueError):  # gone meanwhile, or not JSON: nobody's signed result
            continue
        if result is None:
            continue
        tuning_plan.check_result(result, target=target, torch_version=torch_version, backends=backends,
                                 shape=shape, key=key)
        return result, key, sha256_bytes(data)
    return None


def trusted_keys(job: ExportJob) -> dict:
    """The keys whose tuning results the export applies: its own signing key and KILN_VERIFY_KEY's."""
    from kiln.core.machine.home import kiln_home
    from kiln.host.trust.signers import export_trusted_keys

    return export_trusted_keys(job.signing, kiln_home())


def lookup(store: Store, job: ExportJob, target: str, torch_version: str, backends: str) -> dict[str, dict]:
    """bucket -> {'digest', 'objects', 'missing'} from the results stored for `target`, torch and backends
    that a key the export trusts signed.

    'digest' is `tuning_plan.tuning_digest` of the bucket's results, or None while
    `missing` of its shapes have none (the tune phase measures them and the
    flow probes again). 'objects' lists {'key', 'sha256'} of the results found.
    """
    trusted = trusted_keys(job)
    by_bucket = tuning_plan.export_shapes(job.model_config, job.tp, job.recipe.shapes)
    found = {shape: fetch_result(store, target, torch_version, backends, shape, trusted)
             for shape in tuning_plan.distinct_shapes(by_bucket)}
    out = {}
    for bucket, shapes in by_bucket.items():
        have = [found[s] for s in shapes if found[s] is not None]
        missing = len(shapes) - len(have)
        out[bucket] = {"digest": None if missing else tuning_plan.tuning_digest([r for r, _, _ in have]),
                       "objects": [{"key": k, "sha256": sha} for _, k, sha in have], "missing": missing}
    return out


def load_for_compile(store: Store, specs: list[ForwardSpec], torch_version: str, trusted: dict) -> dict | None:
    """The merged autotune entries `specs` were keyed with, verified; None when none is tuned.

    Each object is fetched against the sha256 its spec recorded, must be signed by a key of `trusted` and be
    for the spec's target and this torch; each spec's digest is recomputed from them, so a forward is never
    compiled with results other than its key says.
    """
    from kiln.core.trust.signed_record import trusted_body

    tuned = [s for s in specs if s.tuning]
    if not tuned:
        return None
    results: dict[str, dict] = {}
    for spec in tuned:
        t = spec.tuning
        if t.get("digest") is None:
            raise KilnError(f"forward {spec.key} ({spec.shapes}) lacks tuning results for {t.get('missing')} "
                            "GEMM shape(s); the tune phase must run before compiling.")
        mine = []
        for ref in t["objects"]:
            if ref["key"] not in results:
                result = trusted_body(json.loads(store.get_bytes(ref["key"], ref["sha256"])), "tuning", trusted)
                if result is None:
                    raise IntegrityError(f"tuning result {ref['key']} is not signed by a key this export trusts; "
                                         "refusing to compile with its kernel choices.")
                tuning_plan.check_result(result, target=spec.target, torch_version=torch_version,
                                         backends=spec.compiler.get("max_autotune_gemm_backends"), key=ref["key"])
                results[ref["key"]] = result
            mine.append(results[ref["key"]])
        if tuning_plan.tuning_digest(mine) != t["digest"]:
            raise IntegrityError(f"the tuning results listed for forward {spec.key} do not give the digest in "
                                 f"its key ({t['digest']}); refusing to compile it with other kernel choices.")
    return tuning_plan.merge_entries(list(results.values()))


def install(entries: dict) -> int:
    """Merge `entries` into this process's Inductor autotune cache file; returns timings written.

    Runs in a compile worker (torch imported). The file is Inductor's local
    autotune cache under its cache dir; the merge holds a file lock, so
    workers installing at once do not lose each other's writes. Stored timings
    replace local ones for the same choice; other local entries are kept.
    """
    from filelock import FileLock
    from torch._inductor.codecache import CacheBase

    cache = CacheBase()
    path = CacheBase.get_local_cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{path}.kiln-lock"):
        local = cache.get_local_cache()
        written = 0
        for op, ins in entries.items():
            for inputs, precs in ins.items():
                for precision, choices in precs.items():
                    slot = local.setdefault(op, {}).setdefault(inputs, {}).setdefault(precision, {})
                    for choice, ms in choices.items():
                        if slot.get(choice) != ms:
                            slot[choice] = ms
                            written += 1
        if written:
            cache.update_local_cache(local)
    return written


def tune_target(job: ExportJob, target: str, *, backends: str | None = None) -> dict:
    """The tune phase for `target`, run on a host of that target; returns what it did.

    Keys of the result: target, mode, backends, status ('ok' or 'skipped'),
    reason (when skipped), shapes, hits (shapes served from the store), misses
    (shapes the store lacked), measured (candidates benchmarked), measure_s
    (seconds spent measuring), changed (whether stored results were created or
    replaced: forward keys may have changed).

    `backends` overrides what weightless forwards may use (benchmarks and the
    tests of this mechanism measure CPU's C++ templates that way; forwards
    never use results measured with backends other than their own).
    """
    mode = job.recipe.tuning
    if mode != "off":
        backends = backends or tuning_plan.gemm_backends(mode, device_of(target))
    out = {"target": target, "mode": mode, "backends": backends, "status": "skipped", "shapes": 0, "hits": 0,
           "misses": 0, "measured": 0, "measure_s": 0.0, "changed": False}
    if mode == "off" or backends is None:
        return {**out, "backends": None, "reason": tuning_plan.untuned_reason(mode, device_of(target))}
    signer = _signer(job)
    if signer is None:
        return {**out, "backends": None, "reason": UNSIGNED_REASON}
    import torch

    here = probe.target_fingerprint(device_of(target))
    if here != target:
        raise KilnError(f"tuning for target {target} must run on a host of that target; this host is {here}.")
    version = torch.__version__
    store = open_store(job.store_url, s3_endpoint=job.s3_endpoint, checksum_mode=job.checksum_mode)
    shapes = tuning_plan.distinct_shapes(tuning_plan.export_shapes(job.model_config, job.tp, job.recipe.shapes))
    trusted = trusted_keys(job)
    stored = {s for s in shapes if fetch_result(store, target, version, backends, s, trusted) is not None}
    decision = tuning_plan.decide(mode, shapes, stored)
    out.update(status="ok", shapes=len(shapes), hits=len(decision.hits), misses=len(set(shapes) - stored))
    if decision.measure:
        run = measure(decision.measure, target=target, torch_version=version, backends=backends,
                      deadline=deadlines.tune_deadline(len(decision.measure), job.recipe))
        _save(store, run, decision, target=target, torch_version=version, backends=backends, signer=signer)
        out.update(measured=run["benchmarked"], measure_s=round(run["measure_s"], 3), changed=True)
    return out


UNSIGNED_REASON = ("an unsigned export tunes nothing: only results a key the export trusts signed pick kernels, "
                   "and nobody could trust what it measured")


def _signer(job: ExportJob):
    """The export's signing key where this runs, or None for an unsigned export."""
    from kiln.core.machine.home import kiln_home
    from kiln.host.trust.signers import export_signer

    return export_signer(job.signing, kiln_home(), socket.gethostname())


def tuning_backends(job: ExportJob, device: str) -> str | None:
    """The GEMM backends the export's forwards are tuned over on `device`, or None when they are not tuned
    (tuning off, nothing to choose between on this device, or an unsigned export: UNSIGNED_REASON)."""
    backends = tuning_plan.gemm_backends(job.recipe.tuning, device)
    return None if backends is None or job.signing is None or not job.signing.sign else backends


def _save(store: Store, run: dict, decision: tuning_plan.TuningDecision, *, target: str, torch_version: str,
          backends: str, signer) -> None:
    """Store each measured shape's result, signed by `signer` (kiln.core.trust.signed_record, kind 'tuning')."""
    from kiln.core.trust.signed_record import sign_record
    from kiln.core.trust.signing import fingerprint

    info = {k: run[k] for k in ("benchmarked", "measure_s", "selections")} | {"shapes": len(decision.measure)}
    for shape in decision.measure:
        entries = run["results"].get(str(shape))
        if not entries:
            raise KilnError(f"tuning GEMM {shape} produced no autotune entries (Inductor offered one candidate?; "
                            f"GEMMs it tuned instead: {run.get('unmatched', [])[:3]}); run with --tuning off, "
                            "or report this with the tune log.")
        result = tuning_plan.build_result(target=target, torch_version=torch_version, backends=backends, shape=shape,
                                     entries=entries, measured_by=socket.gethostname(), run=info)
        key = tuning_plan.object_key(target, torch_version, backends, shape, fingerprint(signer.public_key()))
        doc = sign_record("tuning", result, signer)
        if decision.replace:
            store.put_json(key, doc, overwrite=True)
            continue
        try:
            store.put_json(key, doc)
        except IntegrityError:
            pass  # another export of this signer stored this shape since we looked: theirs is as good


def measure(shapes: tuple[GemmShape, ...], *, target: str, torch_version: str, backends: str,
            deadline: Deadline | None = None) -> dict:
    """Benchmark `shapes` over `backends` in a spawned process; returns its run (see `_measure_in_child`).
    The process's Inductor directories are this user's private ones (kiln.host.compile.inductor_cache),
    checked here first. With a `deadline`, a run past it is killed and fails final (DeadlinePassed, naming
    this host)."""
    dirs = inductor_cache.prepare()
    return call_in_spawned(_measure_in_child, [s.to_dict() for s in shapes], target, torch_version, backends, dirs,
                           deadline=deadline,
                           what=f"tuning {len(shapes)} GEMM shape(s) on host {socket.gethostname()}")


def _measure_in_child(shapes: list[dict], target: str, torch_version: str, backends: str,
                      dirs: inductor_cache.InductorDirs) -> dict:
    """In a fresh process and a fresh Inductor cache dir (inside the private `dirs`' scratch), autotune
    every shape once.

    Returns {'results': {str(shape): entries}, 'benchmarked': candidates,
    'selections': GEMMs autotuned, 'measure_s': seconds, 'unmatched': [...]}.
    """
    from kiln.host.processes import scratch as scratch_dirs

    inductor_cache.use(dirs)  # the precompiled headers too; the cache itself is a fresh one below
    scratch = scratch_dirs.mkdtemp("kiln-tune-")  # this process's own: swept at the next start if it is killed
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(scratch, "inductor")
    try:
        return _autotune(shapes, target, torch_version, backends, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _autotune(raw_shapes: list[dict], target: str, torch_version: str, backends: str, scratch: str) -> dict:
    import torch
    from torch._inductor import select_algorithm
    from torch._inductor.codecache import CacheBase

    here = probe.target_fingerprint(device_of(target))
    if torch.__version__ != torch_version or here != target:
        raise KilnError(f"this tuning process runs torch {torch.__version__} on {here}, "
                        f"not torch {torch_version} on {target}.")
    if not str(CacheBase.get_local_cache_path()).startswith(scratch):
        raise KilnError("Inductor's autotune cache is not in the tuning scratch directory; refusing to measure.")
    shapes = [GemmShape.from_dict(s) for s in raw_shapes]
    seen: list[tuple[str, str, str, list[tuple[int, ...]]]] = []

    def record(timings, name, input_nodes, *rest) -> None:
        sizes = [tuple(int(d) for d in n.get_size()) for n in input_nodes]
        dtype = str(input_nodes[0].get_dtype()).removeprefix("torch.")
        seen.append((name, select_algorithm.create_inputs_key(input_nodes), dtype, sizes))

    select_algorithm.add_feedback_saver(record)
    pairs = sorted({(s.k, s.n, s.dtype) for s in shapes})
    which = [pairs.index((s.k, s.n, s.dtype)) for s in shapes]

    class Gemms(torch.nn.Module):
        """One bias-free linear per (k, n, dtype), applied to one input per shape."""

        def __init__(self):
            super().__init__()
            self.linears = torch.nn.ModuleList(torch.nn.Linear(k, n, bias=False, dtype=getattr(torch, dt))
                                               for k, n, dt in pairs)

        def forward(self, *xs):
            return tuple(self.linears[i](x) for i, x in zip(which, xs))

    inputs = tuple(torch.randn(s.m, s.k, dtype=getattr(torch, s.dtype)) for s in shapes)
    with torch.no_grad():
        program = torch.export.export(Gemms().eval(), inputs)
    before, start = benchmark_count(), time.perf_counter()
    torch._inductor.aoti_compile_and_package(
        program, package_path=os.path.join(scratch, "gemms.pt2"),
        inductor_configs={**compiler_options(backends), "aot_inductor.package_cpp_only": True})
    measure_s, benchmarked = time.perf_counter() - start, benchmark_count() - before
    cache = CacheBase().get_local_cache()
    by_dims = {(s.m, s.k, s.n, s.dtype): s for s in shapes}
    results: dict[str, dict] = {}
    unmatched = []
    for op, inputs_key, dtype, sizes in seen:
        shape = None
        if len(sizes) == 2 and len(sizes[0]) == 2 and len(sizes[1]) == 2 and sizes[0][1] == sizes[1][0]:
            shape = by_dims.get((sizes[0][0], sizes[0][1], sizes[1][1], dtype))
        timings = cache.get(op, {}).get(inputs_key)
        if shape is None or not timings:
            unmatched.append(f"{op}{sizes}")
            continue
        results.setdefault(str(shape), {}).setdefault(op, {})[inputs_key] = timings
    return {"results": results, "benchmarked": benchmarked, "selections": len(seen),
            "measure_s": measure_s, "unmatched": unmatched}
