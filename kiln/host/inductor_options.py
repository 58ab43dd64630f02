"""Inductor options of Kiln's forwards and of the tuning graph: one place, read by compiler and tuner."""

from __future__ import annotations

COMPILER_OPTIONS = {"aot_inductor.package_constants_in_so": False}

FORWARD_DEVICE = "cpu"
"""Where forwards run: `compile_forward` builds the model and its example inputs on the CPU."""


def compiler_options(gemm_backends: str | None) -> dict:
    """A forward's (or the tuning graph's) Inductor options: with `gemm_backends` (e.g. 'ATEN,TRITON'),
    max-autotune picks each GEMM's kernel among them by measured time; None compiles untuned."""
    if gemm_backends is None:
        return dict(COMPILER_OPTIONS)
    return {**COMPILER_OPTIONS, "max_autotune": True, "max_autotune_gemm_backends": gemm_backends}
