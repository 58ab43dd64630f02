"""The `kiln` command: export, plan, serve, verify, run, keygen, checkpoint, bench.

Purpose: parse the command line, check every input before Prefect starts,
and print expected errors as one or two sentences (main.py).

Contracts: the top layer; it may import every other. Recipe flags are derived
from kiln/core/plan/recipe.py, never declared here. Exit codes come from
kiln.core.errors: 0 done, 2 bad input, 3 gate refused or memory short, 1 else.

Pitfalls: heavy imports (torch, prefect) stay inside the command functions, so
bad input answers in about a second; Prefect's environment is set in main()
before Prefect is first imported.
"""
