"""Errors that Kiln expects, each with the exit code the CLI gives it.

Which errors are retried is decided in one place, kiln.core.run.retry_rule.

An expected error carries a message of one or two plain sentences: what is
wrong and how to fix it. The CLI prints it to stderr without a traceback.
"""

import errno


class KilnError(Exception):
    """Base of every expected error; `exit_code` is what `kiln` exits with."""

    exit_code = 1


class BadInput(KilnError):
    """The user's input is wrong; nothing was started and nothing was stored."""

    exit_code = 2


class GateRefused(KilnError):
    """The fail-fast gate refused the export before any compilation.

    A refusal is an answer, not a fault: it is final unless the recipe's
    `retry_refusals` says the deployment waits for memory to be freed.
    `short_hosts`: host -> {'available_mib', 'required_one_mib', 'short_mib'} of
    each host that is short of one compile worker (empty for other refusals).
    """

    exit_code = 3

    def __init__(self, message: str, short_hosts: dict[str, dict] | None = None):
        super().__init__(message)
        self.short_hosts = dict(short_hosts or {})

    def __reduce__(self):  # keeps short_hosts across pickling (Prefect results, Dask)
        return (type(self), (str(self), self.short_hosts))


class HostsLost(KilnError):
    """Hosts kept disappearing during compilation; a later try may find them back (worth retrying)."""

    exit_code = 1


class MemoryShort(KilnError):
    """A check would not fit in the memory available: refused before it starts, never killed midway."""

    exit_code = 3


class IntegrityError(KilnError):
    """An object's bytes do not match the sha256 recorded for them."""

    exit_code = 1


class StoreConflict(IntegrityError):
    """A create-once write found other bytes under its key; `existing` is the sha256 the store records for
    them (None when unrecorded). An instance attribute, so it survives pickling."""

    def __init__(self, message: str, *, existing: str | None = None):
        super().__init__(message)
        self.existing = existing


class VerifyMismatch(KilnError):
    """A compiled forward differs from the eager model by more than the recipe allows."""

    exit_code = 1


class UnloadablePackage(KilnError):
    """A compiled forward cannot be loaded with the rank's weights (it was compiled for others)."""

    exit_code = 1


class CheckCrashed(KilnError):
    """A rank check's process died (a package that crashes when loaded or run, or a kill): final, never
    retried (kiln.core.run.retry_rule: a crash fails the same way again)."""

    exit_code = 1


class NotPythonFree(KilnError):
    """A compiled forward calls an op that only a Python process registering it can run."""

    exit_code = 1


class StoreError(KilnError):
    """The store (or an S3 checkpoint) failed in a way that its own per-request retries did not fix.

    `transient`: the failure may heal later (the store timed out, closed the
    connection or was throttled: see kiln.core.run.retry_rule.transient); false for
    an answer that will not change (access denied, a directory where a key
    should be). Either way its retries are spent: no task or flow retries it
    again (kiln.core.run.retry_rule.retried_per_request). An instance attribute, so
    it survives pickling (Dask, Prefect results), which `__cause__` does not.
    """

    exit_code = 1

    def __init__(self, message: str, *, transient: bool = False):
        super().__init__(message)
        self.transient = transient


class ForwardsMissing(KilnError):
    """Forwards of the export are not in the store after the compile phase (some host failed): a re-run
    compiles only those."""

    exit_code = 1


class DiskError(KilnError):
    """A local disk (a host's cache directory, a local store's directory) cannot take what Kiln writes there."""

    exit_code = 1


DISK_ERRNOS = (errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EPERM, errno.EDQUOT, errno.ENOTDIR, errno.EEXIST)
"""OSError numbers that mean "this disk or directory cannot take the write", not a transient hiccup
(a DiskError when Kiln is the writer)."""


class RankDied(KilnError):
    """A rank process of `kiln verify` or `kiln run` ended without a result (a crash, the OOM killer);
    the message names the rank, its exit code or signal and what it was doing (kiln.core.run.rank_exit)."""

    exit_code = 1


class DeadlinePassed(KilnError):
    """A step of an export (a forward's compile, a rank check, a tuning measurement, a phase) ran past its
    deadline (kiln.core.plan.deadlines) and was stopped: final, never retried (a step that hangs would
    hang again; one that was only slow needs a larger deadline_margin or deadline_floor_s)."""

    exit_code = 1


class RanksTimedOut(KilnError):
    """The ranks of `kiln verify` or `kiln run` were all alive but had not finished in time; they were stopped."""

    exit_code = 1
