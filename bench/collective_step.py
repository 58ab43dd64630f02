"""One decode step at tp 2: Kiln's Python-free package against the same step with a Python custom op.

`python -m bench.collective_step compile DIR` compiles the tiny model's 1x1
(decode) forward twice at tp 2: as Kiln does (torch's native all_reduce, a C
shim in the package) and as Kiln did before (a Python `torch.library`
custom op around `dist.all_reduce`, reached through AOTInductor's proxy
executor). `python -m bench.collective_step rank R RENDEZVOUS DIR REPS STEPS` is one
of two gloo ranks (RENDEZVOUS: a file neither has made yet, their FileStore): it loads both packages with its weight shard and times
STEPS steps of each, REPS times, alternating which goes first; rank 0 writes
DIR/steps.json with every sample.
"""

# No `from __future__ import annotations`: torch.library reads the custom op's annotations as types.

import json
import sys
from pathlib import Path

TP = 2
PAGE_TOKENS, PAGES_PER_SEQ = 16, 4


CUSTOM_GROUP = None
"""The group the custom op reduces over in a rank (its own: see `rank`); None while compiling."""

HANG_S = 600
"""A rank that has not finished after this long dumps every thread's stack into its log and exits 1: gloo's
own default timeout is 30 minutes, longer than the bench waits."""


def _custom_all_reduce():
    """The Python custom op Kiln's forwards used before native collectives (registered on import)."""
    import torch
    import torch.distributed as dist

    @torch.library.custom_op("kilnbench::all_reduce", mutates_args=())
    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        out = x.clone()
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(out, group=CUSTOM_GROUP)
        return out

    @all_reduce.register_fake
    def _(x):
        return torch.empty_like(x)

    return all_reduce


def _spec() -> dict:
    from kiln.core.model.config import TINY
    from kiln.core.forwards.forward_keys import forward_spec
    from kiln.core.plan.recipe import Bucket
    from kiln.core.forwards.shape_ranges import static_shape
    from kiln.host.compile.key_sources import model_code_fingerprint
    from kiln.host.compile.inductor_options import COMPILER_OPTIONS

    return forward_spec(shapes=static_shape(Bucket(1, 1)), graph={"config": TINY.to_dict(), "tp": TP, "code": model_code_fingerprint()},
                        target="bench", torch_version="bench", page_tokens=PAGE_TOKENS, pages_per_seq=PAGES_PER_SEQ,
                        compiler=COMPILER_OPTIONS).to_dict()


def compile_both(out: Path) -> dict:
    """Compile the native and the custom-op package (one after another, in this process)."""
    import kiln.host.model.layers.collectives
    from kiln.host.compile.compiler import _warm, compile_forward

    _warm()
    out.mkdir(parents=True, exist_ok=True)
    native = compile_forward(_spec(), str(out / "native.pt2"))
    kiln.host.model.layers.collectives.all_reduce = _custom_all_reduce()  # what collectives.reduce calls while tracing
    custom = compile_forward(_spec(), str(out / "custom.pt2"))
    info = {"native": native.calls, "custom": custom.calls,
            "compile_s": {"native": native.compile_s, "custom": custom.compile_s}}
    (out / "compiled.json").write_text(json.dumps(info))
    return info


def rank(rank: int, rendezvous: str, out: Path, reps: int, steps: int) -> None:
    """One rank. The custom op reduces over a group of its own and the timing barriers over another, so the
    default group carries only the native package's collectives: a Python collective on the packages' group
    between package calls can leave gloo waiting forever (kiln.host.model.layers.collectives.host_group; the quick
    bench hung here once in CI, at load, with the custom op on the default group). The ranks meet in a file,
    not on a port picked free beforehand that another process may take meanwhile."""
    import datetime
    import faulthandler

    import torch
    import torch.distributed as dist

    from bench.alternating import alternate
    from kiln.core.model.config import TINY
    from kiln.host.ranks.loader import load_forward
    from kiln.store import sha256_file
    from kiln.host.model import example_inputs, host_group, random_state_dict, shard_state_dict

    global CUSTOM_GROUP
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    _custom_all_reduce()  # the custom-op package needs its op registered in the loading process
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=TP,
                            timeout=datetime.timedelta(seconds=HANG_S))
    side = host_group()  # the timing barriers stay off the packages' group
    CUSTOM_GROUP = host_group()
    weights = shard_state_dict(random_state_dict(TINY), TINY, TP, rank)
    packages = {name: load_forward(out / f"{name}.pt2", weights, sha256_file(out / f"{name}.pt2"))
                for name in ("native", "custom")}
    args = example_inputs(TINY, TP, 1, 1, page_tokens=PAGE_TOKENS, pages_per_seq=PAGES_PER_SEQ,
                          num_pages=PAGES_PER_SEQ + 1, seed=rank)
    with torch.no_grad():
        timed = alternate({name: lambda p=p: p(*args) for name, p in packages.items()}, reps, steps,
                          sync=lambda: dist.barrier(group=side))
    dist.destroy_process_group()
    faulthandler.cancel_dump_traceback_later()
    if rank == 0:
        (out / "steps.json").write_text(json.dumps(timed.step_s))


if __name__ == "__main__":
    if sys.argv[1] == "compile":
        print(json.dumps(compile_both(Path(sys.argv[2]))))
    else:
        rank(int(sys.argv[2]), sys.argv[3], Path(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6]))
