"""What earlier runs left on this host, removed at an export's start, and said in one line.

The temporary directories of Kiln processes that are gone (a SIGKILLed rank check leaves its loader's
copies and AOTInductor's extractions: kiln.host.processes.scratch), and the host's cache beyond its cap,
least recently used first, never a forward this export needs (kiln.host.machine.cache.cap_cache); and,
once per export, the store's uploads in parts that killed writers left unfinished (Store.abort_stale_uploads).
Housekeeping: a failure to tidy the host is said and never fails the export.
"""

from __future__ import annotations

from kiln.core.plan.job import HostSpec
from kiln.core.run.tidy import Removed, removed_line
from kiln.host.machine import cache
from kiln.host.processes import scratch


def tidy_host(host: HostSpec, keep_keys: set[str]) -> str | None:
    """Sweep this host's leftovers (see the module docstring); the line saying what was removed, or None."""
    removed: dict[str, Removed] = {}
    try:
        removed["temporary directories of processes gone"] = scratch.sweep()
        cap = cache.cap_bytes()
        removed[f"cached files least recently used over {cache.CACHE_MIB_ENV}={cap // cache.MIB if cap else 0}"] = \
            cache.cap_cache(cache.cache_dir(host), cap, keep_keys)
    except Exception as exc:  # noqa: BLE001 - housekeeping: said, never fatal
        return f"could not tidy host {host.name}: {exc}"
    return removed_line(f"on host {host.name}", removed)


def tidy_store(store, store_url: str) -> str | None:
    """Abort the store's uploads in parts begun more than STALE_UPLOAD_S ago and never completed; the line
    saying what went, or None. Its errors are the store's (the caller decides what a failure means)."""
    from kiln.store.base import STALE_UPLOAD_S

    removed = store.abort_stale_uploads(STALE_UPLOAD_S)
    return removed_line(f"in the store {store_url}",
                        {f"uploads in parts never completed, begun over {STALE_UPLOAD_S / 3600:.0f} h ago": removed})
