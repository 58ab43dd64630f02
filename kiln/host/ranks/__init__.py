"""Ranks at work: a package loaded with a rank's weights, compared with eager, all ranks together.

Purpose: `loader` (load a compiled forward safely: sha256, members, weights'
dtypes and shapes; compare it with eager), `routing_ties` (the 16-bit check of
a mixture of experts) and `verify_ranks` (all ranks under a real gloo group
against the unsharded model; spawn_ranks and join_ranks for kiln run too).

Contracts: a package's constants are loaded and checked before it is called
(calling it first kills the process).
"""
