"""Console and run logging: an expected error is said once, in a sentence or two, never with a traceback.

The rule is kiln.core.run.said_once's; here it is a logging filter on the handlers Prefect and the root
logger use. A record is rewritten once (the first handler's filter marks it), whichever handlers it
reaches.
"""

from __future__ import annotations

import logging

from kiln.core.errors import KilnError
from kiln.core.run.said_once import SaidOnce


class HideExpectedTracebacks(logging.Filter):
    """Drop the traceback of a record whose exception is a KilnError (its message says it all), and say each
    KilnError's text once (kiln.core.run.said_once)."""

    def __init__(self, said: SaidOnce | None = None):
        super().__init__()
        self.said = said or SaidOnce()

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "_kiln_filtered", False):
            return True
        record._kiln_filtered = True
        exc = record.exc_info[1] if record.exc_info else None
        expected = exc if isinstance(exc, KilnError) else None
        if expected is not None:
            record.exc_info = record.exc_text = None
        message = record.getMessage()
        if record.name.startswith("prefect.task_runs"):
            new = self.said.task_line(message, expected)
        else:
            args = record.args if isinstance(record.args, tuple) else ()
            new = self.said.flow_line(message, [a for a in (exc, *args) if isinstance(a, KilnError)])
        if new != message:
            record.msg, record.args = new, ()
        return True


_SAID = SaidOnce()
_FILTER = HideExpectedTracebacks(_SAID)


def said_already(text: str) -> bool:
    """Whether an error with this text was logged already in this process (then a later line refers to it)."""
    return text in _SAID.said


def said(text: str) -> None:
    """Count `text` as said: later records quoting it (Prefect's "Finished in state Failed(...)") refer to it."""
    _SAID.say(text)


def hide_expected_tracebacks() -> None:
    """Install the filter on every console handler Prefect and the root logger use."""
    for name in ("", "prefect", "prefect.flow_runs", "prefect.task_runs"):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, HideExpectedTracebacks) for f in handler.filters):
                handler.addFilter(_FILTER)
