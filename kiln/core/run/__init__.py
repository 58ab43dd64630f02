"""An export's run: leases and holders, the retry rule, the outcome, events, the report, decoding.

Purpose: `leases` and `holders` (who compiles or exports what, and whether a
holder is provably gone), `retry_rule` (what is retried, at which one level),
`outcome` (the compile phase's verdict and the forwards of report and
manifest), `events` (Kiln's Prefect events), `report` and `run_page` (the
report and what a run's page says), `said_once` (an expected error said once),
`rank_exit` (what is said when a rank dies or hangs), `tidy` (what a run
leaves behind and which of it to remove) and `decode` (how a prompt is fed
through an export's buckets).

Contracts: pure; the I/O (the store, Prefect, processes) is the caller's.
"""
