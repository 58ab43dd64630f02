"""Console and run logging: an expected error is said once, in a sentence or two, never with a traceback."""

from __future__ import annotations

import logging

from kiln.core.errors import KilnError


class HideExpectedTracebacks(logging.Filter):
    """Drop the traceback of a record whose exception is a KilnError (the message says it all), and say
    each KilnError's text once: a later record repeating it (Prefect's task and flow failure lines, the
    retry decision) refers to it instead."""

    def __init__(self):
        super().__init__()
        self.said: list[str] = []
        self.in_tasks: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "_kiln_filtered", False):  # one record passes every handler's filter
            return True
        record._kiln_filtered = True
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, KilnError):
            record.exc_info = None
            record.exc_text = None
        args = record.args if isinstance(record.args, tuple) else ()
        if record.name.startswith("prefect.task_runs"):
            # A task's failure lines name the error; the flow's log says it in full, once.
            if isinstance(exc, KilnError) and str(exc) not in self.in_tasks:
                self.in_tasks.append(str(exc))
            message = record.getMessage()
            if isinstance(exc, KilnError):
                message = message.replace(repr(exc), f"{type(exc).__name__} (the flow run's log says why)")
            for text in self.in_tasks:
                message = message.replace(repr(text), "(the flow run's log says why)").replace(
                    text, "(the flow run's log says why)")
            record.msg, record.args = message, ()
            return True
        errors = [a for a in (exc, *args) if isinstance(a, KilnError) and len(str(a)) > 40]
        message = record.getMessage()
        repeated = [t for t in self.said if t in message]
        if repeated:
            for text in repeated:
                message = message.replace(text, "(said above)").replace(repr(text), "(said above)")
            record.msg, record.args = message, ()
        for e in errors:
            if str(e) not in self.said:
                self.said.append(str(e))
        return True


_FILTER = HideExpectedTracebacks()


def said_already(text: str) -> bool:
    """Whether an error with this text was logged already in this process (then a later line refers to it)."""
    return text in _FILTER.said


def said(text: str) -> None:
    """Count `text` as said: later records quoting it (Prefect's "Finished in state Failed(...)") refer to it."""
    if text not in _FILTER.said:
        _FILTER.said.append(text)


def hide_expected_tracebacks() -> None:
    """Install the filter on every console handler Prefect and the root logger use."""
    for name in ("", "prefect", "prefect.flow_runs", "prefect.task_runs"):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, HideExpectedTracebacks) for f in handler.filters):
                handler.addFilter(_FILTER)
