"""Fixtures of the reference tests: transformers' checkpoints, written once per session."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session")
def hf_root(tmp_path_factory) -> Path:
    """Where the session's transformers-written checkpoints live (hf_models.write_case writes each once)."""
    return tmp_path_factory.mktemp("hf-checkpoints")
