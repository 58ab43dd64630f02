"""The export's store, opened where a task (or `kiln plan`'s probe) runs: its Kiln Store block's, or its URL's.

Imports no Prefect unless the job names a block, so `kiln plan` and `kiln export`'s fast refusal stay free of it.
"""

from __future__ import annotations

from kiln.core.plan.job import ExportJob
from kiln.store import open_store


def store_of(job: ExportJob):
    if job.store_block:
        from blocks.kiln_blocks import load_store_block
        return load_store_block(job.store_block).open()
    return open_store(job.store_url, s3_endpoint=job.s3_endpoint, checksum_mode=job.checksum_mode)
