"""A host's part of each export phase: probe, compile, share, check (what tasks/phases.py calls).

Purpose: `host_probe` (the gate's view of this host: its reading, forward
specs and keys, what it and the store hold), `host_compile` (its share of the
compile phase: the pool under leases, each forward vouched for and uploaded),
`share` (which stored forwards may be loaded; a host's copy of those it lacks)
`rank_check` (each rank's forwards against eager in a process of its own)
and `host_tidy` (what earlier runs left on the host, removed at an export's start).

Contracts: knows no Prefect; the flow passes in the job and the store.
"""
