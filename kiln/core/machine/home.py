"""KILN_HOME: where Kiln keeps its default store, model cache, keys and host caches on this machine; and the
rule for a directory that must be private to its user (Inductor's caches: `inductor_root`)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from kiln.core.errors import BadInput

HOME_ENV = "KILN_HOME"
INDUCTOR_DIR_ENV = "KILN_INDUCTOR_DIR"


def kiln_home() -> Path:
    """KILN_HOME resolved (default ./.kiln); read at each call, so a process may change it."""
    return Path(os.environ.get(HOME_ENV, ".kiln")).resolve()


def inductor_root(uid: int) -> Path:
    """Where the compile workers of user `uid` keep Inductor's caches (kiln.host.compile.inductor_cache):
    KILN_INDUCTOR_DIR, else KILN_HOME/inductor-<uid>. Read at each call.

    Under KILN_HOME, not in Inductor's default $TMPDIR/torchinductor_$USER (a name any local user can take
    first) and not in a host's cache directory (one per host name: several hosts on one machine would each
    build the precompiled headers again, and the compile pool does not know its host). One per KILN_HOME and
    user, so it stays warm across exports; tests and the bench, which make a KILN_HOME per run, share one
    through KILN_INDUCTOR_DIR."""
    configured = os.environ.get(INDUCTOR_DIR_ENV)
    return Path(configured).expanduser().resolve() if configured else kiln_home() / f"inductor-{uid}"


def check_private_dir(path: str, *, mode: int, owner_uid: int, uid: int, what: str, fix: str,
                      owner: str | None = None) -> None:
    """BadInput unless `path` (its stat: `mode`, `owner_uid`) is a directory owned by user `uid` with no
    group or other permission bits; the message names `what` it is, the path, its owner (`owner`, e.g.
    'uid 65534 (nobody)') and mode, and `fix` (how to point Kiln elsewhere)."""
    who = owner or f"uid {owner_uid}"
    bits = f"mode {stat.S_IMODE(mode):04o}"
    if not stat.S_ISDIR(mode):
        raise BadInput(f"{what} {path} is not a directory ({bits}, owned by {who}); remove it, or {fix}.")
    if owner_uid != uid:
        raise BadInput(f"{what} {path} belongs to {who}, not to this user (uid {uid}; {bits}): its owner "
                       "controls what the compiler takes from it, and Kiln vouches for what it compiles. Have "
                       f"it removed, or {fix}.")
    if stat.S_IMODE(mode) & 0o077:
        raise BadInput(f"{what} {path} is open to group or others ({bits}, owned by {who}): they could plant "
                       f"entries the compiler would use. Run `chmod 700 {path}`, or {fix}.")
