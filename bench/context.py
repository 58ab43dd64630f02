"""What every part of one suite run shares: settings, the work directory and measurements made once."""

from __future__ import annotations

import getpass
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from bench.runs import PYTHON, Workdir, inductor_root
from kiln.core.errors import BadInput

# The incident (docs/several-hosts.md) on local hosts: one rank per host, two hosts short of one worker.
# Its GB10 workers took 2048 MiB of host memory and a 2048 MiB CUDA context from one pool; CPU hosts stand
# in with 4096 MiB of host memory per worker (a CPU export reserves no device memory).
INCIDENT_SETTINGS = ["headroom_floor_mib=8192", "recipe_headroom_mib=1024", "worker_host_mib=4096",
                     "unified_memory=true"]
INCIDENT_ASSUME = ["host-1=12038", "host-2=11939"]
DEFAULT_COMPILE_S = 20.0
"""Per-forward compile seconds when this run measured none (the tiny model's ~20 s cold on 2 cores; bench/README.md)."""


@dataclass(frozen=True)
class Settings:
    """Sizes of one suite run; `quick` shrinks them to fit in a few minutes."""

    quick: bool
    buckets: str
    """Buckets of the single-host exports and the fail-fast runs: 8 for the full suite."""
    borrow_buckets: str
    """Buckets of the borrow runs: at least one per host, so that all three can compile."""
    tp: int = 2
    """Tensor-parallel degree of the single-host exports."""
    hosts_tp: int = 3
    """Hosts (one rank each) of the fail-fast and borrow layouts."""
    reps: int = 3
    """Repetitions of the Prefect start-up measurement (a no-op flow with and without a server)."""
    store_reps: int = 5
    """Repetitions of the store transfers (a few seconds each)."""
    store_file_mib: tuple[int, ...] = (8, 16, 24, 32)
    s3_read_layers: int = 2
    """Layers of the checkpoint the s3_read part reads from S3 (the tiny model's width: ~7 MiB per layer; its
    exact side makes one GET per row of every column-cut tensor, ~770 per layer per rank)."""
    samples: int = 3
    """Samples per side of every ratio the suite repeats (each sample a fresh cold start, the sides' order
    alternating); the store and collective parts repeat inside themselves (`store_reps`, their own count)."""

    @classmethod
    def for_mode(cls, quick: bool, samples: int | None = None) -> "Settings":
        if samples is not None and samples < 1:
            raise BadInput(f"--samples must be at least 1, not {samples}")
        if quick:
            return cls(quick=True, buckets="1x8", borrow_buckets="1x8,2x8,4x8", reps=1, store_reps=1,
                       store_file_mib=(8, 16), s3_read_layers=1, samples=samples or 1)
        eight = "1x8,2x8,4x8,8x8,1x32,2x32,4x32,8x32"
        # Borrow's two 3-host exports are the suite's longest runs; 4 buckets (at least one per host) keep
        # three samples of them within the suite's half hour.
        return cls(quick=False, buckets=eight, borrow_buckets="1x8,2x8,1x32,2x32", samples=samples or 3)

    @property
    def num_buckets(self) -> int:
        return len(self.buckets.split(","))

    def to_dict(self) -> dict:
        return {"quick": self.quick, "buckets": self.buckets, "num_buckets": self.num_buckets,
                "borrow_buckets": self.borrow_buckets, "tp": self.tp, "hosts_tp": self.hosts_tp, "reps": self.reps,
                "store_reps": self.store_reps, "store_file_mib": list(self.store_file_mib),
                "s3_read_layers": self.s3_read_layers,
                "samples": self.samples}


def precompiled_headers_ready() -> bool:
    """Whether Inductor's precompiled headers exist where every run's compiles keep them: Inductor's default
    cache dir under the runs' KILN_INDUCTOR_DIR (kiln.host.compile.inductor_cache), not a run's own."""
    d = inductor_root() / "tmp" / f"torchinductor_{getpass.getuser()}" / "precompiled_headers"
    return d.exists() and any(d.rglob("*.gch"))


SUITE_ONCE = frozenset({"model", "warm-up", "startup"})
"""Measurements made once per suite run; every other `once` is made once per sample."""


class Context:
    """Settings, work directory and the measurements several parts share (each made at most once per sample).

    The suite runs every part once per sample; `begin_sample` gives each sample its own work directory
    (fresh stores, host caches and Inductor caches) and flips `forward_order`, the order in which a part
    runs the two sides it compares.
    """

    def __init__(self, work: Workdir, settings: Settings, selected: tuple[str, ...] = ()):
        self.base = work
        self.work = work
        self.s = settings
        self.selected = frozenset(selected)
        """The parts this suite run measures (a part makes only the sides that some selected part reads)."""
        self.sample = 0
        self._once: dict[str, object] = {}
        self.notes: dict[str, str] = {}

    def begin_sample(self, index: int) -> None:
        self.sample = index
        self.work = self.base.child(f"sample-{index + 1}")

    @property
    def forward_order(self) -> bool:
        """True on the 1st, 3rd, ... sample: a part runs its sides in their natural order, else reversed."""
        return self.sample % 2 == 0

    def ordered(self, sides: list) -> list:
        return list(sides) if self.forward_order else list(sides)[::-1]

    def tag(self, name: str) -> str:
        """`name` made unique to this sample (S3 prefixes, which the samples share one bucket for)."""
        return f"{name}-s{self.sample + 1}"

    def _key(self, name: str) -> str:
        return name if name in SUITE_ONCE else f"{name}#{self.sample}"

    def once(self, name: str, make: Callable[[], object]):
        key = self._key(name)
        if key not in self._once:
            self._once[key] = make()
        return self._once[key]

    def has(self, name: str) -> bool:
        return self._key(name) in self._once

    @property
    def model(self) -> str:
        """The bundled tiny checkpoint, written once for the suite (not charged to any run)."""
        def make() -> str:
            home = self.work.path("model")
            code = ("import sys; from kiln.host.weights.checkpoint import tiny_checkpoint; "
                    "print(tiny_checkpoint(sys.argv[1]))")
            self.work.run("setup-model", [PYTHON, "-c", code, str(home)],
                          self.work.env(inductor=None, kiln_home="model")).expect(0)
            return str(home / "models" / "tiny")
        return self.once("model", make)

    def warm_up(self) -> None:
        """One throw-away compile, so no cold measurement pays machine-wide one-time costs.

        It builds Inductor's precompiled headers if they are missing (~50 s once per
        machine) and brings torch, g++ and their headers into the page cache; quick
        mode skips it when the headers exist. Then one flow on the embedded API, so
        its database exists before any measured run.
        """
        def make() -> bool:
            if self.s.quick and precompiled_headers_ready():
                self.notes["warm-up"] = "quick: no warm-up compile (precompiled headers already built)"
            else:
                first = self.s.buckets.split(",")[0]
                self.work.run("warm-up-compile",
                              [PYTHON, "-m", "bench.loop", "--model", self.model, "--tp", str(self.s.tp),
                               "--buckets", first, "--out", str(self.work.path("warm-up", "out")),
                               "--json", str(self.work.path("warm-up", "loop.json"))],
                              self.work.env(inductor="warm-up", kiln_home="warm-up/home")).expect(0)
            self.work.run("warm-up-embedded-api", [PYTHON, "-m", "bench.noop_flow"],
                          self.work.env(inductor=None, kiln_home="warm-up/home")).expect(0)
            return True
        self.once("warm-up", make)
