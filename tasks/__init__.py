"""The export's phases as Prefect tasks (phases.py).

Purpose: one task per phase or per host's share of one. Their bodies are the
library's: kiln.host.phases.host_probe, host_compile, share and rank_check on a host,
kiln.core for the decisions; a task opens the export's store (store.py's
`store_of`: a Kiln Store block or a URL) and passes it in.

Contracts: thin tasks: decorators, retries, a call into kiln.core or kiln.host.
Retries only on I/O (transient_only), only for errors that can heal and that no lower level retried
(kiln.core.run.retry_rule: a store error has spent its per-request retries).

Pitfalls: the compile task has no task retries (they would compile its whole
share again); decisions in a task belong to kiln.core instead.
"""
