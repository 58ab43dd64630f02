"""Errors that Kiln expects, each with the exit code the CLI gives it.

An expected error carries a message of one or two plain sentences: what is
wrong and how to fix it. The CLI prints it to stderr without a traceback.
"""


class KilnError(Exception):
    """Base of every expected error; `exit_code` is what `kiln` exits with."""

    exit_code = 1


class BadInput(KilnError):
    """The user's input is wrong; nothing was started and nothing was stored."""

    exit_code = 2


class GateRefused(KilnError):
    """The fail-fast gate refused the export before any compilation."""

    exit_code = 3


class IntegrityError(KilnError):
    """An object's bytes do not match the sha256 recorded for them."""

    exit_code = 1


class StoreError(KilnError):
    """The store failed in a way that retrying did not fix."""

    exit_code = 1


class DiskError(KilnError):
    """A host's local disk (its cache directory) cannot take what Kiln writes there."""

    exit_code = 1
