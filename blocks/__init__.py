"""Prefect blocks and trust: where an export stores, which recipe, which keys sign.

Purpose: `Kiln Store` and `Kiln Recipe` blocks (kiln_blocks.py) configure a
deployment from the UI; trust.py decides which key signs an export and which
keys `kiln verify` trusts.

Contracts: credentials and private keys stay secret: never in task parameters,
logs, reports or artifacts, only a key's fingerprint. The recipe block's fields
are derived from kiln/core/recipe.py.

Pitfalls: register the block types with `prefect block register -m blocks.kiln_blocks`.
"""
