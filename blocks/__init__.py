"""Prefect block classes: where an export stores and which recipe it starts from.

Purpose: `Kiln Store` and `Kiln Recipe` blocks (kiln_blocks.py) configure a
deployment from the UI. Which key signs an export and which keys `kiln verify`
trusts is the library's (kiln.host.trust.signers).

Contracts: credentials stay secret: never in task parameters, logs, reports or
artifacts. The recipe block's fields are derived from kiln/core/plan/recipe.py.

Pitfalls: register the block types with `prefect block register -m blocks.kiln_blocks`.
"""
