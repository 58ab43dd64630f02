"""Fixtures for tests that run what a user runs: the `kiln` CLI in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

KILN = [sys.executable, "-m", "kiln.cli"]


@dataclass
class Run:
    code: int
    out: str
    err: str

    def json(self, path) -> dict:
        return json.loads(Path(path).read_text())


@pytest.fixture(scope="session")
def kiln_env(tmp_path_factory) -> dict:
    """Environment of a fresh user: own KILN_HOME (store, caches, model) and own Prefect home."""
    root = tmp_path_factory.mktemp("kiln")
    env = dict(os.environ)
    env.update(KILN_HOME=str(root / "home"), PREFECT_HOME=str(root / "prefect"),
               PREFECT_SERVER_ANALYTICS_ENABLED="false", PYTHONUNBUFFERED="1")
    env.pop("PREFECT_API_URL", None)
    for name in ("KILN_SIGNING_KEY", "KILN_VERIFY_KEY", "KILN_CACHE_DIR", "KILN_FAULT_KILL_COMPILE", "KILN_FAULT_DIR"):
        env.pop(name, None)  # a fresh user has configured none of these
    return env


@pytest.fixture(scope="session")
def kiln(kiln_env):
    def run(*args: str, env: dict | None = None, timeout: float = 900, cwd=None) -> Run:
        proc = subprocess.run([*KILN, *args], env={**kiln_env, **(env or {})}, capture_output=True,
                              text=True, timeout=timeout, cwd=cwd)
        return Run(proc.returncode, proc.stdout, proc.stderr)
    return run
