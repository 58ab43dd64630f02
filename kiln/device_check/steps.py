"""The device check's steps: each takes the Check and returns its figures (a dict), or raises.

A figure 'skipped' (the reason) marks a step that has nothing to do on this
device. A step that needs an earlier one's result raises Needs when it is
missing. Compiles run in the Check's pool of compile workers
(kiln.host.compile.compiler.CompilePool), never in this process.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import json
import multiprocessing as mp
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

PAGE_TOKENS = 16
PAGES_PER_SEQ = 4
ATOL, HALF_RATIO = 1e-3, 2.0
"""The recipe's defaults for verify_atol and verify_half_ratio (kiln.core.plan.recipe)."""
PREDICTED_WORKER_DEVICE_MIB = 2048
"""What a GPU host's compile worker was assumed to take on the device (the incident's 2 GiB, the recipe's
worker_device_mib advice): each CUDA compile's measured device peak is reported against it."""


class Needs(Exception):
    """A step's input is missing: the step that makes it failed or did not run."""


@dataclass
class Check:
    device: str
    """'cpu' or 'cuda' (the current GPU)."""
    quick: bool
    work: Path
    pool: object = None
    """A kiln.host.compile.compiler.CompilePool, made by the first step that compiles."""
    made: dict = field(default_factory=dict)
    """What steps made for later ones: 'forwards' (name -> CompileResult), 'checkpoint', 'config', 'tokens'."""

    def need(self, key: str, step: str):
        if key not in self.made:
            raise Needs(f"needs the result of step {step}, which failed or did not run")
        return self.made[key]


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _params(fn) -> list[str] | None:
    try:
        return [p for p in inspect.signature(fn).parameters if p != "self"]
    except (TypeError, ValueError):
        return None


def _compiled_model_class():
    import torch._inductor.package as package

    return getattr(package, "AOTICompiledModel", None) or package.package.AOTICompiledModel


def _used_then_hold(queue, hold) -> None:
    """A child: report the device memory in use with its own context made, then hold it until told."""
    import torch

    free, total = torch.cuda.mem_get_info(0)
    queue.put(total - free)
    hold.wait(120)


def context_mib() -> int:
    """One process's CUDA context, torch alone: a first child holds its context while a second reports what
    is in use with its own made too; the difference is the second's context."""
    ctx = mp.get_context("spawn")
    queue, hold = ctx.Queue(), ctx.Event()
    first = ctx.Process(target=_used_then_hold, args=(queue, hold))
    second = None
    first.start()
    try:
        with_one = queue.get(timeout=120)
        second = ctx.Process(target=_used_then_hold, args=(queue, hold))
        second.start()
        with_two = queue.get(timeout=120)
    finally:
        hold.set()
        first.join(30)
        if second is not None:
            second.join(30)
    return -(-(with_two - with_one) // 2**20)


def versions(check: Check) -> dict:
    import torch
    from torch._inductor import select_algorithm

    from kiln.host.machine import device_memory

    model_cls = _compiled_model_class()
    load_params = _params(model_cls.load_constants)
    figures = {
        "python": platform.python_version(), "torch": torch.__version__, "cuda_runtime": torch.version.cuda,
        **{name: _version(name) for name in ("triton", "transformers", "safetensors", "psutil", "nvidia-ml-py")},
        "apis": {"load_constants": load_params, "user_managed": "user_managed" in (load_params or []),
                 "aoti_load_package": _params(torch._inductor.aoti_load_package),
                 "aoti_compile_and_package": _params(torch._inductor.aoti_compile_and_package),
                 "c10d_functional_all_reduce": hasattr(torch.ops._c10d_functional, "all_reduce"),
                 "select_algorithm_feedback_saver": hasattr(select_algorithm, "add_feedback_saver"),
                 "scan": importlib.util.find_spec("torch._higher_order_ops.scan") is not None},
        "cpu": platform.processor() or platform.machine(),
    }
    if check.device == "cpu":
        return {**figures, "cuda_context_mib": "skipped: the CPU holds no context"}
    if not torch.cuda.is_available():
        raise RuntimeError("--device cuda, but torch sees no CUDA device "
                           f"(torch {torch.__version__}, built for CUDA {torch.version.cuda})")
    props = torch.cuda.get_device_properties(0)
    figures.update(gpu=props.name, arch=f"sm_{props.major}{props.minor}", device_count=torch.cuda.device_count(),
                   device_total_mib=props.total_memory // 2**20,
                   unified_memory=bool(getattr(props, "is_integrated", False)),
                   nvml_used_mib=(lambda b: None if b is None else b // 2**20)(device_memory.nvml_used_bytes(0)),
                   cuda_context_mib=context_mib())
    check.made["context_mib"] = figures["cuda_context_mib"]
    return figures


def _pool(check: Check):
    from kiln.host.compile.compiler import CompilePool

    if check.pool is None:
        check.pool = CompilePool(2 if not check.quick else 1)
    return check.pool


def compile_forwards(check: Check, forwards: dict) -> dict:
    """Compile name -> (ModelConfig, tp, Bucket, compiler options) for the device; name -> figures."""
    import torch

    from kiln.core.forwards.forward_keys import forward_spec
    from kiln.core.forwards.shape_ranges import static_shape
    from kiln.host.compile.key_sources import model_code_fingerprint
    from kiln.host.compile.inductor_options import inductor_env

    jobs, names = [], {}
    for name, (cfg, tp, bucket, options) in forwards.items():
        graph = {"config": dict(cfg.__dict__), "tp": tp, "code": model_code_fingerprint(),
                 "inductor_env": inductor_env()}
        if check.device != "cpu":
            graph["device"] = check.device
        spec = forward_spec(shapes=static_shape(bucket), graph=graph, target=f"device-check-{check.device}",
                            torch_version=torch.__version__, page_tokens=PAGE_TOKENS, pages_per_seq=PAGES_PER_SEQ,
                            compiler=options).to_dict()
        names[spec["key"]] = name
        jobs.append((spec, str(check.work / f"{name}.pt2")))
    made = check.made.setdefault("forwards", {})
    figures = {}

    def done(result) -> None:  # as each finishes: a later step may use the ones done when another failed
        name = names[result.key]
        made[name] = result
        figures[name] = {"compile_s": round(result.compile_s, 2), "host_peak_mib": result.peak_mib,
                         "device_peak_mib": result.device_peak_mib, "device_context_mib": result.device_context_mib,
                         "device_allocated_mib": result.device_allocated_mib, "size_bytes": result.size_bytes,
                         "worker_pid": result.pid, "python_free": (result.calls or {}).get("python_free"),
                         "autotune": result.autotune}
        if check.device != "cpu":
            figures[name]["predicted_device_mib"] = PREDICTED_WORKER_DEVICE_MIB
            if result.device_context_mib is None and "context_mib" in check.made:  # no NVML in the worker
                figures[name]["device_peak_mib"] += check.made["context_mib"]
                figures[name]["device_context_mib"] = f"{check.made['context_mib']} (step versions)"

    try:
        _pool(check).run(jobs, done)
    except Exception as exc:
        raise RuntimeError(f"{type(exc).__name__}: {exc}\ncompiled before it: {json.dumps(figures)}") from exc
    return figures


def compile_tiny(check: Check) -> dict:
    from kiln.core.model.config import TINY
    from kiln.core.plan.recipe import Bucket
    from kiln.host.compile.inductor_options import COMPILER_OPTIONS
    from kiln.host.ranks.loader import compare_with_eager, load_forward, place_weights
    from kiln.core.run.outcome import passed
    from kiln.host.model import random_state_dict, shard_state_dict

    bucket = Bucket(1, 8)
    figures = compile_forwards(check, {"tiny": (TINY, 1, bucket, COMPILER_OPTIONS)})
    result = check.made["forwards"]["tiny"]
    weights = place_weights(shard_state_dict(random_state_dict(TINY), TINY, 1, 0), check.device)
    compiled = load_forward(result.path, weights, result.sha256, device=check.device)
    judged = compare_with_eager(compiled, TINY, 1, 0, weights, bucket, page_tokens=PAGE_TOKENS,
                                pages_per_seq=PAGES_PER_SEQ, atol=ATOL, half_ratio=HALF_RATIO, device=check.device)
    if not passed(judged):
        raise AssertionError(f"the tiny package differs from eager by {judged['diff']:.3g} > {judged['limit']:.3g}")
    return {**figures["tiny"], "vs_eager": judged, "user_managed": getattr(compiled, "kiln_user_managed", None)}


def hf_checkpoint(check: Check) -> dict:
    from kiln.device_check.hf_llama import prompt, write_llama
    from kiln.host.weights.checkpoint import inspect_checkpoint

    path = check.work / "llama"
    start = time.perf_counter()
    overrides = write_llama(path, "quick" if check.quick else check.device)
    cfg = inspect_checkpoint(path)
    check.made.update(checkpoint=path, config=cfg, tokens=prompt(cfg.vocab_size))
    return {"write_s": round(time.perf_counter() - start, 2), "transformers_config": overrides,
            "kiln_config": {k: getattr(cfg, k) for k in ("architecture", "dtype", "vocab_size", "hidden_size",
                                                         "num_layers", "num_heads", "num_kv_heads", "head_dim",
                                                         "intermediate_size")}}


def compile_hf(check: Check) -> dict:
    from kiln.core.plan.recipe import Bucket
    from kiln.device_check.hf_llama import PROMPT_TOKENS
    from kiln.host.compile.inductor_options import COMPILER_OPTIONS

    cfg = check.need("config", "hf_checkpoint")
    f32 = cfg.replace(dtype="float32")
    prefill, decode = Bucket(1, PROMPT_TOKENS), Bucket(1, 1)
    forwards = {"hf_tp1_bfloat16": (cfg, 1, prefill, COMPILER_OPTIONS),
                "hf_tp1_float32": (f32, 1, prefill, COMPILER_OPTIONS),
                "hf_tp2_float32": (f32, 2, prefill, COMPILER_OPTIONS)}
    if not check.quick:
        forwards["hf_tp1_bfloat16_decode"] = (cfg, 1, decode, COMPILER_OPTIONS)
    return compile_forwards(check, forwards)


def tp1_vs_transformers(check: Check) -> dict:
    import torch

    from kiln.device_check.hf_llama import prefill_args, reference_logits
    from kiln.host.weights.checkpoint import load_rank_weights
    from kiln.host.ranks.loader import load_forward, place_weights, scaled_diff

    path, cfg, tokens = check.need("checkpoint", "hf_checkpoint"), check.made["config"], check.made["tokens"]
    forwards = check.need("forwards", "compile_hf")
    reference = {dtype: reference_logits(path, tokens, dtype, check.device) for dtype in ("float32", "bfloat16")}
    figures = {"transformers_bfloat16_vs_float32_max_abs_diff":
               float((reference["bfloat16"] - reference["float32"]).abs().max())}
    for dtype in ("float32", "bfloat16"):
        name = f"hf_tp1_{dtype}"
        if name not in forwards:
            raise Needs(f"needs forward {name} from step compile_hf")
        c = cfg.replace(dtype=dtype)
        weights = place_weights(load_rank_weights(path, c, 1, 0), check.device)
        compiled = load_forward(forwards[name].path, weights, forwards[name].sha256, device=check.device)
        with torch.no_grad():
            logits = compiled(*prefill_args(c, 1, tokens, page_tokens=PAGE_TOKENS, pages_per_seq=PAGES_PER_SEQ,
                                            device=check.device))[0].float().cpu()
        figures[f"{dtype}_max_abs_diff"] = float((logits - reference[dtype]).abs().max())
        figures[f"{dtype}_scaled_diff_vs_transformers_float32"] = scaled_diff(logits, reference["float32"])
    # Both against transformers in float32; bfloat16 may be off by HALF_RATIO times transformers' own
    # bfloat16 error (kiln.host.ranks.loader.judge's rule).
    own = scaled_diff(reference["bfloat16"], reference["float32"])
    figures["limits"] = {"float32": ATOL, "bfloat16": max(ATOL, HALF_RATIO * own)}
    bad = [d for d, limit in figures["limits"].items() if figures[f"{d}_scaled_diff_vs_transformers_float32"] > limit]
    if bad:
        raise AssertionError(f"the tp 1 package differs from transformers beyond the limit in {bad}: {figures}")
    return figures


def tp2_gloo(check: Check) -> dict:
    from kiln.device_check.ranks import gloo_ranks
    from kiln.host.ranks.loader import limit_of

    path, cfg, tokens = check.need("checkpoint", "hf_checkpoint"), check.made["config"], check.made["tokens"]
    forward = check.need("forwards", "compile_hf").get("hf_tp2_float32")
    if forward is None:
        raise Needs("needs forward hf_tp2_float32 from step compile_hf")
    rank0_file = str(check.work / "rank0.pt")
    figures = gloo_ranks(checkpoint=str(path), config=dict(cfg.replace(dtype="float32").__dict__),
                         path=forward.path, sha256=forward.sha256, tokens=tokens, page_tokens=PAGE_TOKENS,
                         pages_per_seq=PAGES_PER_SEQ, device=check.device, rank0_file=rank0_file)
    check.made["rank0_file"] = rank0_file
    figures["ranks"] = f"2 on {check.device}" + (":0" if check.device == "cuda" else "")
    limit = limit_of(None, atol=ATOL, half_ratio=HALF_RATIO)
    if figures["ranks_max_abs_diff"] != 0.0 or figures["vs_unsharded_scaled_diff"] > limit:
        raise AssertionError(f"tp 2 ranks differ from each other or from the unsharded model: {figures}")
    return figures


def nccl_rank0(check: Check) -> dict:
    if check.device == "cpu":
        return {"skipped": "NCCL needs CUDA"}
    import torch

    from kiln.host.trust.package_check import package_calls
    from kiln.device_check.ranks import torch_only_rank0

    forward = check.need("forwards", "compile_hf").get("hf_tp2_float32")
    if forward is None:
        raise Needs("needs forward hf_tp2_float32 from step compile_hf")
    rank0_file = check.need("rank0_file", "tp2_gloo")
    runs = {backend: torch_only_rank0(forward.path, rank0_file, backend, check.device,
                                      check.work / f"rank0-{backend}.pt") for backend in ("gloo", "nccl")}
    gloo, nccl = (torch.load(runs[b]["logits_file"]) for b in ("gloo", "nccl"))
    figures = {"ran_under_nccl": True, "torch_only": not ({"kiln"} & set(runs["nccl"]["top_modules"])),
               "nccl_vs_gloo_max_abs_diff": float((nccl - gloo).abs().max()),
               "package_calls": package_calls(forward.path).to_dict()}
    if figures["nccl_vs_gloo_max_abs_diff"] > ATOL:
        raise AssertionError(f"rank 0 under NCCL differs from rank 0 under gloo: {figures}")
    return figures


def _median_ms(fn, device: str, repeats: int) -> float:
    import torch

    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        if device != "cpu":
            torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        if device != "cpu":
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1000)
    return statistics.median(times)


def decode_time(check: Check) -> dict:
    import torch

    from kiln.device_check.hf_llama import PROMPT_TOKENS
    from kiln.host.weights.checkpoint import load_rank_weights
    from kiln.host.ranks.loader import eager_model, load_forward, place_weights
    from kiln.host.model import example_inputs

    path, cfg = check.need("checkpoint", "hf_checkpoint"), check.made["config"]
    forwards = check.need("forwards", "compile_hf")
    name = "hf_tp1_bfloat16_decode" if "hf_tp1_bfloat16_decode" in forwards else "hf_tp1_bfloat16"
    if name not in forwards:
        raise Needs(f"needs forward {name} from step compile_hf")
    forward = forwards[name]
    bucket = (1, 1) if name.endswith("decode") else (1, PROMPT_TOKENS)
    weights = place_weights(load_rank_weights(path, cfg, 1, 0), check.device)
    compiled = load_forward(forward.path, weights, forward.sha256, device=check.device)
    eager = eager_model(cfg, 1, weights, device=check.device)
    args = tuple(a.to(check.device) for a in example_inputs(
        cfg, 1, *bucket, page_tokens=PAGE_TOKENS, pages_per_seq=PAGES_PER_SEQ, num_pages=PAGES_PER_SEQ + 2))
    repeats = 10 if check.device == "cpu" else 50
    with torch.no_grad():
        package_ms = _median_ms(lambda: compiled(*args), check.device, repeats)
        eager_ms = _median_ms(lambda: eager(*args), check.device, repeats)
    return {"forward": name, "bucket": f"{bucket[0]}x{bucket[1]}", "context_tokens": PAGE_TOKENS * PAGES_PER_SEQ,
            "package_ms": round(package_ms, 3), "eager_ms": round(eager_ms, 3),
            "eager_over_package": round(eager_ms / package_ms, 2), "repeats": repeats}


def tuning(check: Check) -> dict:
    if check.device == "cpu":
        return {"skipped": "weightless CPU packages have nothing to tune (kiln.core.plan.tuning_plan)"}
    from kiln.core.model.config import TINY
    from kiln.core.plan.recipe import Bucket
    from kiln.host.compile.inductor_options import compiler_options

    options = compiler_options("ATEN,TRITON")
    forward = (TINY, 1, Bucket(4, 8), options)
    first = compile_forwards(check, {"tiny_tuned": forward})["tiny_tuned"]
    second = compile_forwards(check, {"tiny_tuned_again": forward})["tiny_tuned_again"]
    return {"first": first, "second": second, "note": "the second compile finds the first's timings in "
            "Inductor's autotune cache on this host; Kiln's store of tuning results (kiln.host.compile.tuner) is not "
            "exercised here"}


STEPS = (("versions", versions), ("compile_tiny", compile_tiny), ("hf_checkpoint", hf_checkpoint),
         ("compile_hf", compile_hf), ("tp1_vs_transformers", tp1_vs_transformers), ("tp2_gloo", tp2_gloo),
         ("nccl_rank0", nccl_rank0), ("decode_time", decode_time), ("tuning", tuning))
"""(name, function) in the order they run."""
