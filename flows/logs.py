"""Console logging: expected errors are one or two sentences, never a traceback."""

from __future__ import annotations

import logging

from kiln.core.errors import KilnError


class HideExpectedTracebacks(logging.Filter):
    """Drop the traceback of a record whose exception is a KilnError (the message says it all)."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, KilnError):
            record.exc_info = None
            record.exc_text = None
        return True


def hide_expected_tracebacks() -> None:
    """Install the filter on every console handler Prefect and the root logger use."""
    filt = HideExpectedTracebacks()
    for name in ("", "prefect", "prefect.flow_runs", "prefect.task_runs"):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, HideExpectedTracebacks) for f in handler.filters):
                handler.addFilter(filt)
