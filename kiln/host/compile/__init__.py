"""Compiling forwards: the worker pool, its workers' start, the export call, Inductor options, key sources, tuning.

Purpose: `compiler` (CompilePool: AOTInductor in worker processes, never
threads), `worker_start` (workers forked from a server that imported torch
and Kiln once), `export_call` (the model on meta, torch.export, the Inductor
call), `inductor_options`, `key_sources` (the code hashed into every forward
key) and `tuner` (Inductor max-autotune measured in a spawned process, stored,
installed), `inductor_cache` (the private directories Inductor's caches live
in, for every compile process).

Contracts: compilation runs in processes; what shapes a package is in
key_sources.KEY_SOURCES, what only schedules it is not.
"""
