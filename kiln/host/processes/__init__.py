"""Processes Kiln starts: they die with their parent, calls in fresh spawned processes, peaks, fault points.

Purpose: `procs` (die with the parent, the Reaper, PeakSampler reading /proc),
`spawned` (one call in a fresh spawned process, its answer or its error with
the child's traceback, within its deadline), `scratch` (a temporary directory
per process, swept once its owner is gone) and `faults` (places a test may break; nothing in Kiln
installs a hook).

Contracts: every process started by Kiln dies with its parent; compiling is
never done in a thread (BACKGROUND.md).
"""
