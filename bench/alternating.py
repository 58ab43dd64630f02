"""Time several steps side by side in one process, alternating which goes first, so noise hits each alike.

`alternate(calls, num_reps, num_steps, *, sync=None, after=None) -> Alternated` is the step scripts' one
timing loop (bench.range_step, depth_step, moe_step, decode_context, mla_step, collective_step):

- warm-up: each call once, in `calls`' order, untimed; what each returned is kept (`Alternated.warm`), so a
  caller can check the sides agree;
- then `num_reps` rounds, each running every side once, round i starting at side i (mod the number of
  sides) in `calls`' order: with two sides A B, B A, A B, ...;
- a sample is `num_steps` calls of one side back to back, timed with time.perf_counter; it records the
  seconds per call (the sample's time / num_steps);
- `sync()` (a barrier across ranks) runs just before the clock starts, and again after the last call, before
  the clock stops, so every rank times the same span;
- `after(name)` runs after each sample, untimed, before the next side's (a peak-memory probe).

It imports only `time`: the caller holds torch.no_grad, the thread count and the process group.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Alternated:
    warm: dict[str, object]
    """Each side's warm-up result."""
    step_s: dict[str, list[float]]
    """Each side's seconds per call, one sample per round, in round order."""


def alternate(calls: dict[str, Callable[[], object]], num_reps: int, num_steps: int, *,
              sync: Callable[[], object] | None = None,
              after: Callable[[str], object] | None = None) -> Alternated:
    """Warm each call once, then `num_reps` rounds of `num_steps` calls per side, the first side rotating."""
    warm = {name: call() for name, call in calls.items()}
    names = list(calls)
    step_s: dict[str, list[float]] = {name: [] for name in names}
    for i in range(num_reps):
        for name in names[i % len(names):] + names[:i % len(names)]:
            call = calls[name]
            if sync:
                sync()
            start = time.perf_counter()
            for _ in range(num_steps):
                call()
            if sync:
                sync()
            step_s[name].append((time.perf_counter() - start) / num_steps)
            if after:
                after(name)
    return Alternated(warm=warm, step_s=step_s)
