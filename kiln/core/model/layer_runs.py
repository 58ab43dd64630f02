"""Which decoder layers compile as one loop. Pure.

Layers of one kind (the same tensors and code: dense or mixture-of-experts; DeepSeek-V4's attention kind and
routing) are a run: their weights stack along a leading layer dimension (kiln.core.model.contract's
`model.runs.<j>.<suffix>`), and the forward scans them with one compiled body, so its compile does not grow
with depth.

Where kinds alternate (DeepSeek-V4's default HCA, CSA, HCA, CSA, ...; Qwen3-MoE's decoder_sparse_step 2),
runs of consecutive layers would be one layer each. Instead a segment of layers repeating a pattern of
`period` kinds is one scan whose body runs `period` layers, one of each run: run k of the segment holds its
layers start + k, start + k + period, ... The segments are found greedily from the first layer: at each
layer the period (up to MAX_PERIOD) whose pattern repeats over the most layers, at least twice, the shortest
period on a tie.

    kinds  A A A B C B C B C B      segments [0, 3) period 1, [3, 9) period 2, [9, 10) period 1
    runs   0: layers 0-2   1: 3, 5, 7   2: 4, 6, 8   3: 9
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from kiln.core.model.config import ModelConfig

MAX_PERIOD = 4
"""The longest pattern of kinds one loop body runs (its compile grows with it)."""


@dataclass(frozen=True)
class Segment:
    """Layers [start, stop) repeating a pattern of `period` kinds: one scan, `period` layers per iteration."""

    start: int
    stop: int
    period: int

    @property
    def repeats(self) -> int:
        return (self.stop - self.start) // self.period

    def runs(self) -> list[range]:
        """Each phase's layers, in phase order."""
        return [range(self.start + k, self.stop, self.period) for k in range(self.period)]


def segments_of(kinds: Sequence[Hashable]) -> list[Segment]:
    """The segments of layers whose kinds are `kinds` (see the module docstring)."""
    out, i, n = [], 0, len(kinds)
    while i < n:
        best, covered = 1, 1
        while i + covered < n and kinds[i + covered] == kinds[i]:
            covered += 1
        for period in range(2, MAX_PERIOD + 1):
            length = 0
            while i + length < n and kinds[i + length] == kinds[i + length % period]:
                length += 1
            whole = length // period * period
            if whole >= 2 * period and whole > covered:
                best, covered = period, whole
        out.append(Segment(i, i + covered, best))
        i += covered
    return out


def layer_kinds(cfg: ModelConfig) -> list[Hashable]:
    """Each decoder layer's kind: layers of one kind have the same tensors and code."""
    kind = cfg.v4.kind if cfg.v4 is not None else cfg.is_moe
    return [kind(i) for i in range(cfg.num_layers)]


def segments(cfg: ModelConfig) -> list[Segment]:
    return segments_of(layer_kinds(cfg))


def layer_runs(cfg: ModelConfig) -> list[range]:
    """Each run's layers, run j being the stacked constants `model.runs.<j>.*`: segment by segment, phase by
    phase. A model whose kinds do not alternate has runs of consecutive layers, range(start, stop)."""
    return [run for segment in segments(cfg) for run in segment.runs()]
