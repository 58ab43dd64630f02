"""Inductor options of Kiln's forwards and of the tuning graph, and the Inductor settings in force.

One place, read by compiler and tuner. A forward compiles with its spec's
options (`compiler_options`) on top of the Inductor settings its worker reads
at import: torch._inductor.config takes most of its defaults from
TORCHINDUCTOR_* environment variables (TORCHINDUCTOR_FREEZING, for one), and a
spawned compile worker inherits the host's environment. `inductor_env` is that
part of the environment, and a forward key hashes it. It is read from the
environment, not from this process's torch._inductor.config: the config cannot
tell an environment default from torch's own, and a setting changed in this
process never reaches a spawned worker.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

COMPILER_OPTIONS = {"aot_inductor.package_constants_in_so": False}

FORWARD_DEVICE = "cpu"
"""Where a forward runs when its graph names no device: the CPU (the tuner's weightless CPU packages too)."""

DEVICES = ("cpu", "cuda")
"""The devices a forward is compiled for: the graph's 'device' (absent: FORWARD_DEVICE). A CUDA forward is
compiled on a GPU host, by a worker that holds a CUDA context, on that worker's current GPU; the package
runs on any GPU of the same target (the loader picks the rank's)."""

INDUCTOR_ENV_PREFIXES = ("TORCHINDUCTOR_", "TORCH_INDUCTOR_")
"""The environment variables Inductor reads its settings from."""

INDUCTOR_ENV_UNKEYED = frozenset({
    # Where Inductor keeps its files, and its own caches (torch keys their entries by what shapes them).
    "TORCHINDUCTOR_CACHE_DIR", "TORCHINDUCTOR_FX_GRAPH_CACHE", "TORCHINDUCTOR_FX_GRAPH_CACHE_DEFAULT",
    "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE", "TORCHINDUCTOR_AUTOGRAD_CACHE", "TORCHINDUCTOR_AUTOGRAD_REMOTE_CACHE",
    # How many processes compile, how they start, how long they wait for each other.
    "TORCHINDUCTOR_COMPILE_THREADS", "TORCHINDUCTOR_WORKER_START", "TORCHINDUCTOR_COMPILE_WORKER_WAIT_TIMEOUT",
    "TORCHINDUCTOR_FILE_LOCK_TIMEOUT",
    # What the compile workers log.
    "TORCHINDUCTOR_WORKER_SUPPRESS_LOGGING", "TORCHINDUCTOR_WORKER_LOGPATH",
})
"""Inductor variables that change no generated code, so no key (torch itself sets TORCHINDUCTOR_CACHE_DIR
in a process that compiles). Any other one is keyed: one set to its default costs a compile, never a wrong
package."""


def forward_device(graph: Mapping) -> str:
    """The device a forward's `graph` (a spec's 'graph') is compiled for and runs on; ValueError for another."""
    device = graph.get("device", FORWARD_DEVICE)
    if device not in DEVICES:
        raise ValueError(f"a forward's device is one of {', '.join(DEVICES)}, not {device!r}")
    return device


def compiler_options(gemm_backends: str | None) -> dict:
    """A forward's (or the tuning graph's) Inductor options: with `gemm_backends` (e.g. 'ATEN,TRITON'),
    max-autotune picks each GEMM's kernel among them by measured time; None compiles untuned."""
    if gemm_backends is None:
        return dict(COMPILER_OPTIONS)
    return {**COMPILER_OPTIONS, "max_autotune": True, "max_autotune_gemm_backends": gemm_backends}


def inductor_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The Inductor settings in `environ` (default: this process's environment, which its compile workers
    inherit): name -> value of each INDUCTOR_ENV_PREFIXES variable not in INDUCTOR_ENV_UNKEYED, sorted."""
    env = os.environ if environ is None else environ
    return {name: env[name] for name in sorted(env)
            if name.startswith(INDUCTOR_ENV_PREFIXES) and name not in INDUCTOR_ENV_UNKEYED}
