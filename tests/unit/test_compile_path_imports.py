"""Kiln's compile, load and compare path, and the device check, import without prefect, boto3, dask or
cryptography (a GPU host has torch, transformers, safetensors and psutil only: docs/gpu.md)."""

from __future__ import annotations

import subprocess
import sys

from device_check_harness import REPO, blocked_env

MODULES = ("kiln.device_check.__main__", "kiln.device_check.steps", "kiln.device_check.ranks",
           "kiln.device_check.hf_llama", "kiln.host.compile.compiler", "kiln.host.compile.export_call", "kiln.host.ranks.loader",
           "kiln.host.ranks.verify_ranks", "kiln.host.machine.device_memory", "kiln.host.weights.checkpoint", "kiln.core.forwards.forward_keys")

SCRIPT = r"""
import importlib, sys
for name in sys.argv[1:]:
    importlib.import_module(name)
from kiln.host.compile.compiler import _warm
_warm()  # what every compile worker imports before its first forward (the tuner's install among it)
from sitecustomize import BLOCKED
leaked = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED and sys.modules[m] is not None)
assert not leaked, leaked
print("IMPORTS-OK")
"""


def test_compile_load_compare_path_imports_without_service_dependencies():
    proc = subprocess.run([sys.executable, "-c", SCRIPT, *MODULES], cwd=REPO, env=blocked_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "IMPORTS-OK" in proc.stdout, proc.stdout + proc.stderr


def test_the_blocker_blocks():
    proc = subprocess.run([sys.executable, "-c", "import cryptography"], cwd=REPO, env=blocked_env(),
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr
