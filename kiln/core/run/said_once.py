"""An expected error is said once in a run's log: later lines that quote it refer to it instead. Pure.

Prefect repeats a failure's text on several lines: the task's failure line, the
flow's "Finished in state Failed(...)" and Kiln's own retry decision. A reader
needs the text once, in the flow run's log, where Kiln says it in full. So:
- a task's line names the error's type and says that the flow run's log says
  why (`task_line`);
- any other line that quotes a text said already refers to it: "(said above)"
  (`flow_line`), and the texts it says itself count as said from then on.

flows/logs.py applies this to Prefect's log records; this module sees text only.
"""

from __future__ import annotations

FLOW_SAYS_WHY = "(the flow run's log says why)"
SAID_ABOVE = "(said above)"
MIN_CHARS = 40
"""A text shorter than this is not worth referring to (it is shorter than the reference)."""


class SaidOnce:
    """The expected errors' texts a log has said, and those its tasks' lines quoted."""

    def __init__(self) -> None:
        self.said: list[str] = []
        self.in_tasks: list[str] = []

    def say(self, text: str) -> None:
        """Count `text` as said: a later line quoting it refers to it."""
        if text not in self.said:
            self.said.append(text)

    def task_line(self, message: str, error: BaseException | None) -> str:
        """A task's line: `error` (an expected one, or None) named by its type, and the texts of expected errors
        that its tasks quoted replaced by a pointer to the flow run's log."""
        if error is not None:
            if str(error) not in self.in_tasks:
                self.in_tasks.append(str(error))
            message = message.replace(repr(error), f"{type(error).__name__} {FLOW_SAYS_WHY}")
        for text in self.in_tasks:
            message = message.replace(repr(text), FLOW_SAYS_WHY).replace(text, FLOW_SAYS_WHY)
        return message

    def flow_line(self, message: str, errors: list[BaseException]) -> str:
        """Any other line: each text said already replaced by SAID_ABOVE; then the texts of `errors` (the
        expected errors this line carries) count as said."""
        for text in [t for t in self.said if t in message]:
            message = message.replace(text, SAID_ABOVE).replace(repr(text), SAID_ABOVE)
        for error in errors:
            if len(str(error)) > MIN_CHARS:
                self.say(str(error))
        return message
