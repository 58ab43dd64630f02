"""Memory at a real model's size: a Llama-3.2-1B-shaped checkpoint exported end to end at tp 2.

Makes the checkpoint locally (hidden 2048, 16 layers, 32 heads, 8 KV heads,
head_dim 64, MLP 8192, vocab 128256, tied embeddings, bfloat16; random
weights, ~2.5 GB), then, each as a user runs it:

1. `kiln export --buckets 1x16`: the first export of this graph; nothing is
   measured yet, so the gate counts the recipe's estimate per worker. Each
   compile records its worker's peak (worker and g++ children, sampled).
2. `kiln export --buckets 1x16,4x16` into the same store: the gate now counts
   the measured peak (times worker_mib_margin) and compiles 4x16.
3. `kiln verify` of the second export.
4. rank 0's weights loaded in a fresh process (bench.loader_peak): the loader's
   peak memory over the rank's weight bytes (target <= 1.15: stacked constants
   are filled in place, never a second copy).

Prints one JSON document: the worker peak measured while compiling 4x16 over
the per-worker figure the gate predicted for it from the 1x16 measurement
(target 0.8-1.0, never above), compile seconds per bucket, the in-flow rank
check's and `kiln verify`'s peak memory against their predictions, and the
tiny model's worker peak for scale.

Usage: .venv/bin/python bench/scale_1b.py [--workdir DIR] [--keep]   (make bench-1b; ~10 minutes, ~12 GiB)
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kiln.core.model.config import ModelConfig  # noqa: E402
from kiln.host.weights.checkpoint import random_checkpoint  # noqa: E402

LLAMA_32_1B = ModelConfig(vocab_size=128256, hidden_size=2048, num_layers=16, num_heads=32, num_kv_heads=8,
                          head_dim=64, intermediate_size=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
                          dtype="bfloat16", rope_type="llama3", rope_factor=32.0, rope_low_freq_factor=1.0,
                          rope_high_freq_factor=4.0, rope_original_max_position=8192, tie_word_embeddings=True)


def kiln(*args: str, env: dict) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "cli.main", *args], env=env, capture_output=True, text=True)
    if proc.returncode:
        raise SystemExit(f"kiln {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return proc, round(time.perf_counter() - start, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", help="where the checkpoint, store and homes go (default: a temporary folder)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kiln-1b-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "KILN_HOME": str(work / "home"), "PREFECT_HOME": str(work / "prefect"),
           "PYTHONPATH": str(ROOT)}
    env.pop("PREFECT_API_URL", None)
    try:
        ckpt = work / "llama-3.2-1b-shaped"
        t0 = time.perf_counter()
        if not (ckpt / "config.json").exists():
            random_checkpoint(ckpt, LLAMA_32_1B, seed=0, num_shards=4)
        make_s = round(time.perf_counter() - t0, 1)
        store = f"file://{work / 'store'}"
        common = ["--model", str(ckpt), "--tp", "2", "--store", store]
        _, first_s = kiln("export", *common, "--buckets", "1x16", "--export-id", "first",
                          "--report", str(work / "first.json"), env=env)
        _, second_s = kiln("export", *common, "--buckets", "1x16,4x16", "--export-id", "second",
                           "--report", str(work / "second.json"), env=env)
        verified, verify_s = kiln("verify", "second", "--store", store, env=env)
        loaded = subprocess.run([sys.executable, "-m", "bench.loader_peak", str(ckpt), "2", "0"], env=env,
                                capture_output=True, text=True, check=True, cwd=ROOT)
        loader = json.loads(loaded.stdout.strip().splitlines()[-1])
        first = json.loads((work / "first.json").read_text())
        second = json.loads((work / "second.json").read_text())
        f1 = {f["shapes"]: f for f in first["forwards"]}
        f2 = {f["shapes"]: f for f in second["forwards"]}
        host1, host2 = first["hosts"][0], second["hosts"][0]
        peak = int(re.search(r"memory: peak (\d+) MiB", verified.stdout)[1])
        predicted = int(re.search(r"predicted (\d+) MiB", verified.stdout)[1])
        figures = {
            "params_m": round(LLAMA_32_1B.num_params() / 1e6),
            "checkpoint_write_s": make_s,
            "compile_s_per_bucket": {"1x16": f1["1x16"]["compile_s"], "4x16": f2["4x16"]["compile_s"]},
            "worker_peak_mib": {"1x16": f1["1x16"]["compile_peak_mib"], "4x16": f2["4x16"]["compile_peak_mib"]},
            "first_export_worker_mib": [host1["worker_mib"], host1["worker_mib_source"]],
            "second_export_worker_mib": [host2["worker_mib"], host2["worker_mib_source"]],
            "worker_measured_over_predicted": round(f2["4x16"]["compile_peak_mib"] / host2["worker_mib"], 3),
            "check_peak_mib": host1["verify_memory"]["peak_mib"],
            "check_predicted_mib": host1["verify_memory"]["predicted_mib"],
            "check_measured_over_predicted": round(host1["verify_memory"]["peak_mib"]
                                                   / host1["verify_memory"]["predicted_mib"], 3),
            "verify_peak_mib": peak, "verify_predicted_mib": predicted,
            "verify_measured_over_predicted": round(peak / predicted, 3),
            "export_s": {"first": first_s, "second": second_s}, "verify_s": verify_s,
            "compile_lowest_available_mib": host1["compile_memory"]["min_available_mib"],
            "loader_weight_mib": round(loader["weight_bytes"] / 2**20),
            "loader_peak_over_weights": loader["peak_over_weights"],
        }
        print(json.dumps(figures, indent=2))
    finally:
        if not args.keep and not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
