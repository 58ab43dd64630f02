"""The plan of an export: the recipe, the hosts' probes, sizing, the gate and its decisions, tuning.

Purpose: `recipe` and `settings` (every per-run choice, declared once),
`job` (the export as every task receives it), `probe_result` (what a host
reported), `sizing` (compile workers and the KV plan, in MiB), `gate` (a plan
or a refusal naming each short host), `decisions` (probes -> KV plan -> gate,
and the replan after lost hosts), `deadlines` (how long each step may run)
and `tuning_plan` (which GEMM shapes to measure and where their results live).

Contracts: pure functions of plain data; memory in MiB and time in seconds,
as the names say; a measurement is an argument, never taken here.
"""
