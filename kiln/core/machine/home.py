"""KILN_HOME: where Kiln keeps its default store, model cache, keys and host caches on this machine."""

from __future__ import annotations

import os
from pathlib import Path

HOME_ENV = "KILN_HOME"


def kiln_home() -> Path:
    """KILN_HOME resolved (default ./.kiln); read at each call, so a process may change it."""
    return Path(os.environ.get(HOME_ENV, ".kiln")).resolve()
