"""`python -m kiln.device_check`, run as a GPU host runs it: a subprocess in which prefect, boto3, dask and
cryptography cannot be imported (tests/blocked_deps), every step's JSON line read back.

The CPU run (--quick) is the suite's one compile of the check: the tiny model and a transformers Llama
(bfloat16, head_dim 128, GQA) at tp 1 in two dtypes and at tp 2, in one spawned worker. The CUDA run is
marked `gpu` and skips without a CUDA device.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from device_check_harness import REPO, blocked_env

pytest.importorskip("transformers", reason="transformers is a test dependency: pip install -e '.[test]'")

STEPS = ("versions", "compile_tiny", "hf_checkpoint", "compile_hf", "tp1_vs_transformers", "tp2_gloo",
         "nccl_rank0", "decode_time", "tuning")


def run_check(tmp_path: Path, *args: str, timeout_s: float) -> list[dict]:
    out = tmp_path / "check.jsonl"
    proc = subprocess.run([sys.executable, "-m", "kiln.device_check", *args, "--json", str(out)], cwd=REPO,
                          env=blocked_env(), capture_output=True, text=True, timeout=timeout_s)
    lines = [json.loads(line) for line in out.read_text().splitlines()] if out.exists() else []
    failed = [{k: v for k, v in line.items() if k != "traceback"} | {"traceback": line.get("traceback", "")[-1500:]}
              for line in lines if not line["ok"]]
    assert proc.returncode == 0 and not failed, f"failed steps: {failed}\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}"
    assert [line["step"] for line in lines] == list(STEPS)
    return lines


@pytest.mark.slow
def test_device_check_on_cpu(tmp_path):
    lines = {line["step"]: line for line in run_check(tmp_path, "--device", "cpu", "--quick", timeout_s=900)}
    assert lines["versions"]["apis"]["load_constants"]  # the APIs relied on are named
    assert lines["compile_tiny"]["vs_eager"]["diff"] <= lines["compile_tiny"]["vs_eager"]["limit"]
    assert lines["tp1_vs_transformers"]["float32_max_abs_diff"] < 1e-3
    assert lines["tp2_gloo"]["ranks_max_abs_diff"] == 0.0
    assert lines["nccl_rank0"]["skipped"] and lines["tuning"]["skipped"]


def _cuda_missing() -> str | None:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return f"no CUDA device (torch {torch.__version__}, CUDA build: {torch.version.cuda or 'none'})"
    return None


@pytest.mark.gpu
@pytest.mark.slow
def test_device_check_on_cuda(tmp_path):
    missing = _cuda_missing()
    if missing:
        pytest.skip(f"the CUDA device check needs a GPU: {missing}")
    lines = {line["step"]: line for line in run_check(tmp_path, "--device", "cuda", timeout_s=1200)}
    assert lines["compile_tiny"]["device_peak_mib"] > 0
    assert lines["nccl_rank0"]["ran_under_nccl"] and lines["nccl_rank0"]["torch_only"]
