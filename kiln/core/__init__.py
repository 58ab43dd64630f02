"""Kiln's pure core: every decision an export makes, as functions of plain data.

Purpose: worker sizing, the KV plan, the fail-fast gate, forward keys, the
recipe and its settings schema, the manifest, signing, the report and the
outcome check, each unit-tested on paper without a server.

Contracts: no torch, prefect, boto3, dask, safetensors or transformers import
(tests/unit/test_layers.py); nothing here does I/O beyond what a caller hands
in; memory is MiB and time seconds, as the names say.

Pitfalls: a decision that needs a measurement takes it as an argument; the
measuring belongs to kiln.host or tasks, never here.
"""
