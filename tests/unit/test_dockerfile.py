"""infra/Dockerfile copies every package that pyproject.toml installs, so the image's `kiln` command runs."""

from __future__ import annotations

import fnmatch
import shlex
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _installed_packages() -> set[str]:
    """Top-level packages in the repo that [tool.setuptools.packages.find] includes."""
    include = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    return {d.name for d in REPO.iterdir() if (d / "__init__.py").exists()
            and any(fnmatch.fnmatch(d.name, pattern) for pattern in include)}


def _copied(dockerfile: str) -> set[str]:
    """Sources of the Dockerfile's COPY lines, normalised (`cli`, `./cli/` and `cli/` are one)."""
    out = set()
    for line in dockerfile.splitlines():
        if line.split()[:1] != ["COPY"]:
            continue
        words = shlex.split(line, comments=True)
        out |= {w.strip("./") or "." for w in words[1:-1] if not w.startswith("--")}
    return out


def test_the_image_copies_every_installed_package():
    packages = _installed_packages()
    assert {"kiln", "flows", "tasks", "blocks", "cli", "bench"} <= packages  # the include list was read
    copied = _copied((REPO / "infra" / "Dockerfile").read_text())
    assert "." in copied or packages <= copied, f"infra/Dockerfile does not COPY {sorted(packages - copied)}"
    assert {"pyproject.toml", "README.md"} <= copied  # what `pip install -e .` reads


def test_the_check_sees_a_missing_package():
    assert "cli" not in _copied("FROM x\nCOPY kiln kiln\nCOPY --chown=1 flows ./flows/\n# COPY cli cli\n")
    assert _copied("COPY ./cli/ cli\n") == {"cli"}
