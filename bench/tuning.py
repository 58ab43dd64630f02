"""Kernel tuning figures, measured side by side in one run; prints one JSON document.

1. tuning cold vs warm: `kiln.host.compile.tuner.tune_target` for the model's buckets on a
   fresh store (every GEMM candidate benchmarked in a spawned process) and
   the same call again (every shape a verified store hit). CPU forwards cannot
   use Inductor's C++ GEMM templates (they prepack weights at compile time;
   see kiln/core/plan/tuning_plan.py), so this measures CPU's ATen-vs-C++ candidates
   explicitly (backends ATEN,CPP): the mechanism's cost, and what the store saves.
2. tune_target with mode full vs cached on that warm store.
3. `kiln export --tuning full` vs `--tuning cached`: two real exports on one
   warm store (forwards compiled by a first export); wall-clock and
   tune-phase seconds. On a CPU host the tune phase skips in both (nothing a
   weightless forward could choose), which the figures show.

Usage: .venv/bin/python bench/tuning.py [--buckets 1x16,2x16,4x32,8x64] [--skip-export]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kiln.core.model.config import TINY  # noqa: E402
from kiln.core.plan.job import ExportJob  # noqa: E402
from kiln.core.plan.recipe import Recipe, parse_buckets  # noqa: E402
from kiln.host.machine import probe
from kiln.host.compile import tuner

BACKENDS = "ATEN,CPP"


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, round(time.perf_counter() - start, 3)


def tuning_figures(tmp: Path, buckets: str) -> dict:
    from kiln.host.trust.signers import plan_signing
    from kiln.store import LocalStore

    # Tuning results are applied only when signed (docs/tuning.md): sign them with a development key of its own.
    os.environ["KILN_HOME"] = str(tmp / "home")
    signing, _ = plan_signing(sign=True, block=None, store=LocalStore(tmp / "tuning-store"), home=tmp / "home")
    job = ExportJob(export_id="bench", model_name="tiny", checkpoint=str(tmp / "none"),
                    config=dataclasses.asdict(TINY), tp=2, recipe=Recipe(buckets=parse_buckets(buckets)),
                    store_url=f"file://{tmp / 'tuning-store'}", signing=signing)
    target = probe.target_fingerprint()
    cold, cold_s = timed(lambda: tuner.tune_target(job, target, backends=BACKENDS))
    warm, warm_s = timed(lambda: tuner.tune_target(job, target, backends=BACKENDS))
    full_job = dataclasses.replace(job, recipe=dataclasses.replace(job.recipe, tuning="full"))
    full, full_s = timed(lambda: tuner.tune_target(full_job, target, backends=BACKENDS))
    cached, cached_s = timed(lambda: tuner.tune_target(job, target, backends=BACKENDS))
    keep = ("shapes", "measured", "hits", "misses", "measure_s")
    return {"backends": BACKENDS, "buckets": buckets,
            "cold": {"seconds": cold_s, **{k: cold[k] for k in keep}},
            "warm": {"seconds": warm_s, **{k: warm[k] for k in keep}},
            "cold_over_warm": round(cold_s / max(warm_s, 1e-3), 1),
            "full": {"seconds": full_s, **{k: full[k] for k in keep}},
            "cached": {"seconds": cached_s, **{k: cached[k] for k in keep}},
            "full_over_cached": round(full_s / max(cached_s, 1e-3), 1)}


def export(env: dict, store: str, buckets: str, mode: str, report: Path) -> dict:
    cmd = [sys.executable, "-m", "cli.main", "export", "--model", "tiny", "--tp", "2", "--buckets", buckets,
           "--store", store, "--tuning", mode, "--report", str(report)]
    proc, seconds = timed(lambda: subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=ROOT))
    if proc.returncode:
        raise SystemExit(f"export --tuning {mode} failed:\n{proc.stderr[-3000:]}")
    r = json.loads(report.read_text())
    tune = next(p for p in r["phases"] if p["name"] == "tune")
    return {"seconds": seconds, "tune_s": tune["duration_s"], "tune_status": tune["status"],
            "tune_reason": tune.get("reason"), "tuning_measured": r["counts"]["tuning_measured"],
            "compiled": r["counts"]["compiled"]}


def export_figures(tmp: Path, buckets: str) -> dict:
    env = {**os.environ, "KILN_HOME": str(tmp / "home"), "PREFECT_HOME": str(tmp / "prefect"),
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "120"}
    env.pop("PREFECT_API_URL", None)
    store = f"file://{tmp / 'export-store'}"
    first = export(env, store, buckets, "cached", tmp / "first.json")
    full = export(env, store, buckets, "full", tmp / "full.json")
    cached = export(env, store, buckets, "cached", tmp / "cached.json")
    return {"buckets": buckets, "first": first, "full": full, "cached": cached,
            "full_over_cached": round(full["seconds"] / cached["seconds"], 2),
            "tune_full_over_cached": round(full["tune_s"] / max(cached["tune_s"], 1e-3), 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--buckets", default=",".join(str(b) for b in Recipe().buckets))
    p.add_argument("--skip-export", action="store_true", help="only the tuning figures (no Prefect, no compile)")
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="kiln-bench-tuning-") as d:
        tmp = Path(d)
        out = {"target": probe.target_fingerprint(), "cpus": probe.num_cpus(),
               "tuning": tuning_figures(tmp, args.buckets)}
        if not args.skip_export:
            out["export"] = export_figures(tmp, args.buckets)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
