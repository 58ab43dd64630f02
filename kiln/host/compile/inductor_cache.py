"""Inductor's caches for Kiln's compile processes: private to the user, never a shared, predictable path.

Left alone, Inductor keeps its caches in $TMPDIR/torchinductor_$USER: the FX
graph cache, the compiled kernels and the precompiled headers every CPU kernel
includes. Any local user can create that directory first and so control what
the compiler takes from it, and Kiln vouches for what it compiles. So every
process that compiles a forward or tunes kernels for one (the pool's workers,
the tuner's child, the bench's loop) uses directories Kiln made:

- the root, `kiln.core.machine.home.inductor_root` (KILN_INDUCTOR_DIR, else
  KILN_HOME/inductor-<uid>), created mode 0700 and refused (BadInput) when it
  is not a directory of this user without group or other bits;
- Inductor's cache (TORCHINDUCTOR_CACHE_DIR): <root>/cache, or the operator's
  TORCHINDUCTOR_CACHE_DIR where set, checked the same way (created 0700 when
  absent), so a run that wants a cold cache still gets one. One that names
  Inductor's own default counts as unset: importing Inductor writes that
  default into the environment (torch's `cache_dir()`), so in any process
  that imported it the variable is set without anyone choosing it;
- the temporary directory (TMPDIR and `tempfile`): <root>/tmp. Inductor's
  *default* cache directory, which holds the precompiled headers and some
  caches whatever TORCHINDUCTOR_CACHE_DIR says, is derived from it.

`prepare` (in the process that starts the compile processes, before any does
anything) makes and checks them; `use` (in each such process, first) points
Inductor at them, including the path of the precompiled headers torch fixed
when it was imported (the pool's server imports Inductor before any worker
exists), and refuses to go on if Inductor still names another place. The
root outlives exports: the caches stay warm from one export to the next.
TORCHINDUCTOR_CACHE_DIR changes no generated code
(kiln.host.compile.inductor_options.INDUCTOR_ENV_UNKEYED), so no key depends
on where the caches are.
"""

from __future__ import annotations

import getpass
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kiln.core.errors import BadInput, KilnError
from kiln.core.machine.home import INDUCTOR_DIR_ENV, check_private_dir, inductor_root

CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"


@dataclass(frozen=True)
class InductorDirs:
    """The private directories of one user's compile processes (absolute paths, made and checked)."""

    root: str
    cache: str
    """Inductor's cache (TORCHINDUCTOR_CACHE_DIR)."""
    tmp: str
    """The processes' TMPDIR: Inductor's default cache directory (precompiled headers) lives under it."""


def prepare(where: str = "this host") -> InductorDirs:
    """Make (mode 0700) and check this user's Inductor directories; BadInput, prefixed with `where`, naming
    a directory that belongs to someone else or is open to group or others, and the fix."""
    uid = os.geteuid()
    fix = f"point {INDUCTOR_DIR_ENV} (or KILN_HOME) at a directory of your own"
    try:
        root = private_dir(inductor_root(uid), uid, what="Kiln's Inductor cache root", fix=fix)
        configured = os.environ.get(CACHE_ENV)
        if configured and os.path.abspath(configured) == inductor_default_dir():
            configured = None  # torch's own default, written by its import: the very path to avoid
        cache = (private_dir(Path(configured).expanduser().resolve(), uid, what=CACHE_ENV,
                             fix=f"unset {CACHE_ENV} (Kiln then uses {root / 'cache'})") if configured
                 else private_dir(root / "cache", uid, what="Kiln's Inductor cache", fix=fix))
        tmp = private_dir(root / "tmp", uid, what="Kiln's compile scratch", fix=fix)
    except BadInput as exc:
        raise BadInput(f"{where}: {exc}") from None
    return InductorDirs(root=str(root), cache=str(cache), tmp=str(tmp))


def use_for_loading() -> None:
    """In a process that loads packages and compiles none (a rank check's, a rank of `kiln verify` or `kiln run`,
    after kiln.host.processes.scratch.adopt): Inductor's cache is this user's private one (`prepare`), not the
    process's own temporary directory. AOTInductor's loader builds and loads a small library per vector ISA to
    learn the CPU's (torch's `pick_vec_isa`, for its device check); in a fresh directory every process built
    them again (about 7 s of g++ each on 2 busy cores, against 1.5 s to find them built). The directory that
    AOTInductor extracts packages into stays the process's own (TMPDIR). Where the private cache cannot be made
    or is not private, the process keeps its own, as before."""
    try:
        dirs = prepare()
    except BadInput:
        return
    os.environ[CACHE_ENV] = dirs.cache


def private_dir(path: Path, uid: int, *, what: str, fix: str) -> Path:
    """`path`, created with mode 0700 (and its missing parents) when absent, then checked
    (kiln.core.machine.home.check_private_dir); BadInput when it cannot be made or is not private."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            path.mkdir(mode=0o700)
            os.chmod(path, 0o700)  # whatever the umask left
        except FileExistsError:
            pass
        st = os.stat(path)
    except OSError as exc:
        raise BadInput(f"{what} {path} cannot be made: {exc.strerror or exc} ({exc.filename or path}); {fix}.") from None
    check_private_dir(str(path), mode=st.st_mode, owner_uid=st.st_uid, uid=uid, what=what, fix=fix,
                      owner=owner_name(st.st_uid))
    return path


def inductor_default_dir() -> str:
    """Inductor's default cache directory in this process, as torch names it without TORCHINDUCTOR_CACHE_DIR
    (torch._inductor.runtime.cache_dir_utils.default_cache_dir: $TMPDIR/torchinductor_<user>)."""
    try:
        user = getpass.getuser()
    except (KeyError, OSError):
        user = f"uid_{os.getuid()}"
    return os.path.abspath(os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user)))


def owner_name(uid: int) -> str:
    """'uid 65534 (nobody)', or 'uid N' where the user database does not know it."""
    try:
        import pwd

        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def use(dirs: InductorDirs) -> None:
    """Point this process (and the processes it starts) at `dirs`: TORCHINDUCTOR_CACHE_DIR, TMPDIR and
    `tempfile`'s directory, and, where torch's Inductor is imported already, the precompiled headers' path it
    fixed at import. KilnError when Inductor still names a directory outside `dirs` (a torch that keeps its
    caches some other way: compiling would use a path Kiln did not check)."""
    os.environ[CACHE_ENV] = dirs.cache
    os.environ["TMPDIR"] = dirs.tmp
    tempfile.tempdir = dirs.tmp
    codecache = sys.modules.get("torch._inductor.codecache")
    if codecache is not None and hasattr(codecache, "_HEADER_DIR"):
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        codecache._HEADER_DIR = os.path.join(default_cache_dir(), "precompiled_headers")
        codecache._HEADER_LOCK_DIR = os.path.join(codecache._HEADER_DIR, "locks")
    if "torch._inductor" in sys.modules:
        from torch._inductor.runtime.cache_dir_utils import cache_dir, default_cache_dir

        places = {"cache_dir()": cache_dir(), "default_cache_dir()": default_cache_dir(),
                  "precompiled headers": getattr(codecache, "_HEADER_DIR", None) or dirs.tmp}
        stray = {name: p for name, p in places.items() if not _inside(p, (dirs.cache, dirs.tmp))}
        if stray:
            raise KilnError(f"Inductor keeps {', '.join(f'{n} in {p}' for n, p in stray.items())}, outside Kiln's "
                            f"private directories {dirs.cache} and {dirs.tmp}; this torch keeps its caches in a "
                            "way Kiln does not know, so nothing is compiled.")


def _inside(path: str, roots: tuple[str, ...]) -> bool:
    real = os.path.realpath(path)
    return any(real == os.path.realpath(r) or real.startswith(os.path.realpath(r) + os.sep) for r in roots)
