"""Running Kiln as a GPU host has it: prefect, boto3, dask and cryptography not importable.

`blocked_env()` is the environment of a subprocess (and of every process it spawns, which inherit it) whose
first PYTHONPATH entry is tests/blocked_deps, whose sitecustomize makes those modules fail to import.
"""

from __future__ import annotations

import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BLOCKED_DEPS = REPO / "tests" / "blocked_deps"


def blocked_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join((str(BLOCKED_DEPS), str(REPO)))}
