"""Kiln's benchmark suite: every claim as a ratio of two things measured side by side in one run.

Purpose: `kiln bench [--quick] [PART ...]` (bench.suite) runs the parts and
writes bench/results/<UTC stamp>.json, .md and .png.

Contracts: each figure compares two measurements of the same run on the same
machine: the median of its samples (3 per side in a full run, the sides'
order alternating between samples; every sample kept in the JSON, with the
commit measured and whether its code had uncommitted changes); cold measurements each get a fresh
Inductor cache, store and host cache; servers are started before any
measurement and never charged to one; every figure's note says what it
includes. Pure pieces (figures, the capture-size list, the gate on paper)
import no torch.

Anti-patterns: comparing with a number from another run or another machine;
asserting thresholds in CI (the smoke test checks only that figures exist).

Pitfalls: on a shared machine every figure is noisy; the result records the
load average during the run. The "hosts" of the 3-host parts share this
machine's CPUs.
"""
