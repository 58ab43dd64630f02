"""The Prefect flows: the export, its compile phase across hosts, deployments.

Purpose: orchestrate the phases (export.py), run per-host tasks on their hosts
(hosts.py), and serve the flow as a deployment (serve.py); ExportParams
(params.py) is the one parameter model of the CLI, the flow and the run form.

Contracts: the flow only orchestrates; decisions are calls into kiln.core, side
effects run in tasks. The report is written whatever happens.

Pitfalls: several hosts need a real Prefect server, not the embedded API; a
`dask worker` started by an operator needs DASK_DISTRIBUTED__WORKER__DAEMON=False
(docs/several-hosts.md). Flow retries follow the recipe (retry.py).
"""
