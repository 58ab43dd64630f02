"""The export's phases as Prefect tasks (phases.py) and their bodies on one host (hostwork.py).

Purpose: one task per phase or per host's share of one; hostwork.py holds the
store I/O, the compile pool calls and the checks that run on the host.

Contracts: thin tasks: decorators, retries, a call into kiln.core or hostwork.
Retries only on I/O (transient_only), only for errors that can heal and that no lower level retried
(kiln.core.retry_rule: a store error has spent its per-request retries).

Pitfalls: the compile task has no task retries (they would compile its whole
share again); decisions in a task belong to kiln.core instead.
"""
