"""What runs on one host: probe, compile pool, tuner, loader, the model, processes.

Purpose: the side effects of one host, with torch: measure the host, compile
forwards in worker processes (forked from a preloaded server), load packages
and check them against eager, read checkpoints, keep the host cache.

Contracts: imports kiln.core and kiln.store only (of Prefect, only trust.py's
Secret block, where a signing key may be kept); the decisions come from
kiln.core and are passed in. Every process started here dies with its parent
(procs.die_with_parent) and never compiles in a thread.

Pitfalls: only model.py and checkpoint.py import torch at module level; the
others import it where it is used, so the CLI's input checks stay fast.
faults.py is test-only and does nothing unless its variables are set.
"""
