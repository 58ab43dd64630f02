"""The C++ runner (runner/kiln_runner.cpp) runs a tp 2 export without Python and matches Kiln's eager model.

The test builds the runner (CMake, against the wheel's libtorch), compiles one weightless tp 2 forward,
writes a bf16 checkpoint in two shards (so the runner reads an index and casts to the float32 the
package was compiled for) and a version 5 manifest from kiln.core.model.contract, signed and stored as Kiln
stores it, runs two ranks of the runner over a TCPStore and compares each rank's logits with
`ShardedDecoder(cfg, 1)` on the full weights. The same export, changed one thing at a time (a byte of the
manifest, the key, the package, the target), is refused by name before anything loads.
"""

from __future__ import annotations

import base64
import hashlib
import json
import platform
import re
import shutil
import subprocess
import threading
from pathlib import Path

import numpy as np
import pytest
from cpp_runner_harness import RUNNER_ENV, build_runner, free_port, run_ranks, runner_command

pytestmark = pytest.mark.slow

BATCH, TOKENS, PAGE_TOKENS, PAGES_PER_SEQ = 1, 8, 16, 4


@pytest.fixture(scope="module")
def runner() -> Path:
    """The runner, built by `make runner-build` (`make test` leaves the build to this fixture)."""
    return build_runner()


@pytest.fixture(scope="module")
def export(tmp_path_factory) -> dict:
    """A tp 2 export of a 2-layer model (its layers one stacked scan): bf16 checkpoint (2 shards), one 1x8 package,
    a version 5 manifest signed by a key of its own ('key', 'fingerprint', 'verify_key': its public PEM)."""
    import torch

    from kiln.core.model.config import TINY
    from kiln.core.model.contract import PROCESS_GROUP, weight_layout
    from kiln.core.model.interface import forward_interface
    from kiln.core.forwards.forward_keys import forward_spec
    from kiln.core.plan.recipe import Bucket
    from kiln.core.forwards.shape_ranges import static_shape
    from kiln.host.weights.checkpoint import write_checkpoint
    from kiln.host.compile.compiler import CompilePool
    from kiln.host.compile.key_sources import model_code_fingerprint
    from kiln.host.compile.inductor_options import COMPILER_OPTIONS
    from kiln.host.model import random_state_dict
    from kiln.host.machine.probe import cpu_fingerprint
    from kiln.core.trust.signing import fingerprint, generate, public_pem

    root = tmp_path_factory.mktemp("cpp-export")
    # head_dim 32: the rotary frequencies are too long for Inductor to inline; they must come from the graph.
    cfg = TINY.replace(num_layers=2, hidden_size=64, num_heads=4, num_kv_heads=2, head_dim=32,
                       intermediate_size=128, vocab_size=128)
    tp = 2
    full = {n: t.to(torch.bfloat16) for n, t in random_state_dict(cfg, seed=3).items()}
    checkpoint = write_checkpoint(root / "model", cfg, full, num_shards=2)
    spec = forward_spec(shapes=static_shape(Bucket(BATCH, TOKENS)), graph={"config": cfg.__dict__, "tp": tp,
                                                            "code": model_code_fingerprint()},
                        target="test", torch_version="test", page_tokens=PAGE_TOKENS, pages_per_seq=PAGES_PER_SEQ,
                        compiler=COMPILER_OPTIONS).to_dict()
    forwards = root / "store" / "forwards"
    forwards.mkdir(parents=True)
    with CompilePool(1) as pool:
        [result] = pool.run([(spec, str(forwards / f"{spec['key']}.pt2"))], lambda r: None)
    layout = weight_layout(cfg, tp)
    key = generate()
    # The signed bytes are the stored file's without its whitespace (runner/trust.cpp); values Python and a
    # C++ JSON library spell differently (1e-06, escapes, non-ASCII) show that no re-encoding is verified.
    manifest = {
        "version": 5, "export_id": "cpp-runner-test", "tp": tp,
        "model": {"name": "t\u00e9st \"q\" \\ {x: 1}", "checkpoint": str(checkpoint), "config": dict(cfg.__dict__)},
        "recipe": {"page_tokens": PAGE_TOKENS, "max_context_tokens": PAGE_TOKENS * PAGES_PER_SEQ,
                   "verify_atol": 1e-06, "verify_half_ratio": 0.02},
        "runtime": {"process_group": PROCESS_GROUP, "world_size": tp, "python_free": True},
        "signing": {"signed": True, "key_fingerprint": fingerprint(key.public_key())},
        "weights": layout,
        "forwards": [{"key": spec["key"], **static_shape(Bucket(BATCH, TOKENS)).to_dict(),
                      "target": cpu_fingerprint(), "object": f"forwards/{spec['key']}.pt2",
                      "sha256": hashlib.sha256(Path(result.path).read_bytes()).hexdigest(), "python_free": True,
                      "interface": forward_interface(cfg, tp, spec["inputs"]), "constants": sorted(layout)}],
    }
    manifest_path = _write_signed(root / "store" / "exports" / "cpp", manifest, key)
    (root / "verify.pub").write_bytes(public_pem(key.public_key()))
    return {"root": root, "cfg": cfg, "full": full, "manifest": manifest_path, "forwards": forwards, "key": key,
            "fingerprint": fingerprint(key.public_key()), "verify_key": root / "verify.pub"}


def _write_signed(directory: Path, manifest: dict, key) -> Path:
    """manifest.json and manifest.sig in `directory`, written as Kiln's store writes them and signed by `key`."""
    from kiln.core.trust.signing import sign_manifest
    from kiln.store.base import json_bytes

    directory.mkdir(parents=True, exist_ok=True)
    (directory / "manifest.json").write_bytes(json_bytes(manifest))
    (directory / "manifest.sig").write_bytes(json_bytes(sign_manifest(manifest, key)))
    return directory / "manifest.json"


def _resigned(export: dict, directory: Path, change) -> Path:
    """The export's manifest after `change(manifest)`, signed again by its own key: what the checks after the
    signature see."""
    manifest = json.loads(export["manifest"].read_text())
    change(manifest)
    return _write_signed(directory, manifest, export["key"])


def _run_ranks(runner: Path, export: dict, tokens: list[int], out: Path, world_size: int = 2, *,
               manifest: Path | None = None, packages: Path | None = None, extra: tuple[str, ...] | None = None,
               env: dict | None = None) -> list:
    """Both ranks of the 1x8 step; by default on the export as made, trusting its key (--verify-key)."""
    extra = ("--verify-key", str(export["verify_key"])) if extra is None else extra
    return run_ranks(runner, manifest or export["manifest"], packages or export["forwards"], f"{BATCH}x{TOKENS}",
                     tokens, out, world_size, extra=extra, env=env)


def _refused(results: list, message: str) -> None:
    for code, stderr in results:
        assert code == 1 and message in stderr, stderr[-2000:]


def _eager_logits(export: dict, tokens: list[int]):
    import torch

    from kiln.host.model import ShardedDecoder, shard_state_dict

    cfg = export["cfg"]
    model = ShardedDecoder(cfg, 1).eval()
    model.load_state_dict(shard_state_dict({n: t.to(torch.float32) for n, t in export["full"].items()}, cfg, 1, 0))
    num_pages = PAGES_PER_SEQ * BATCH + 1
    cache = torch.zeros(cfg.num_layers, 2, num_pages, PAGE_TOKENS, cfg.num_kv_heads, cfg.head_dim)
    table = torch.arange(BATCH * PAGES_PER_SEQ).reshape(BATCH, PAGES_PER_SEQ)
    with torch.no_grad():
        logits, _ = model(torch.tensor(tokens).reshape(BATCH, TOKENS), torch.zeros(BATCH, dtype=torch.long),
                          cache, table)
    return logits.numpy()


def test_two_cpp_ranks_match_eager(runner, export, tmp_path):
    tokens = [(7 * i + 3) % export["cfg"].vocab_size for i in range(BATCH * TOKENS)]
    results = _run_ranks(runner, export, tokens, tmp_path / "logits-{rank}.f32")
    for rank, (code, stderr) in enumerate(results):
        assert code == 0, f"rank {rank}: {stderr[-3000:]}"
        assert f"signature ok: signed by {export['fingerprint']}" in stderr, stderr[-2000:]
        copy = Path(re.search(r"loading its private copy (\S+)", stderr).group(1))
        assert copy.parent != export["forwards"] and not copy.parent.exists(), "the private copy outlived the load"
    want = _eager_logits(export, tokens)
    for rank in range(2):
        out = tmp_path / f"logits-{rank}.f32"
        side = json.loads(Path(f"{out}.json").read_text())
        assert side["shape"] == [BATCH, TOKENS, export["cfg"].vocab_size] and side["dtype"] == "float32"
        got = np.fromfile(out, dtype="<f4").reshape(side["shape"])
        diff = float(np.abs(got - want).max())
        print(f"rank {rank}: max |logit diff| vs eager = {diff:.3g}")
        assert diff < 1e-4, f"rank {rank}: logits differ from eager by {diff}"


def test_a_manifest_changed_after_signing_is_refused(runner, export, tmp_path):
    """One byte of the signed manifest changed (its forward's sha256, as if pointed at other bytes) and the old
    signature kept: every rank refuses, naming the signature and its key, before it reads any package."""
    d = tmp_path / "exports" / "cpp"
    d.mkdir(parents=True)
    data = export["manifest"].read_bytes()
    at = data.index(b'"sha256": "') + len(b'"sha256": "')
    (d / "manifest.json").write_bytes(data[:at] + (b"0" if data[at:at + 1] != b"0" else b"1") + data[at + 1:])
    shutil.copy(export["manifest"].with_name("manifest.sig"), d / "manifest.sig")
    _refused(_run_ranks(runner, export, [0] * (BATCH * TOKENS), tmp_path / "x", manifest=d / "manifest.json"),
             f"the signature {d / 'manifest.sig'} of manifest {d / 'manifest.json'} does not verify with key "
             f"{export['fingerprint']}: the manifest was changed after it was signed")


def test_a_manifest_signed_by_an_untrusted_key_or_checked_by_none_is_refused(runner, export, tmp_path):
    from kiln.core.trust.signing import fingerprint, generate, public_pem

    other = generate().public_key()
    (tmp_path / "other.pub").write_bytes(public_pem(other))
    sig = export["manifest"].with_name("manifest.sig")
    tokens = [0] * (BATCH * TOKENS)
    _refused(_run_ranks(runner, export, tokens, tmp_path / "x", extra=("--verify-key", str(tmp_path / "other.pub"))),
             f"is signed by key {export['fingerprint']} ({sig}), which is not a trusted verify key "
             f"(trusted: {fingerprint(other)})")
    _refused(_run_ranks(runner, export, tokens, tmp_path / "x", extra=()),
             f"no key to check the signature {sig} of manifest {export['manifest']}")


def test_an_unsigned_manifest_is_refused_unless_allowed_and_said(runner, export, tmp_path):
    """Without manifest.sig: refused; with --allow-unsigned, still refused while the manifest says it was signed."""
    d = tmp_path / "exports" / "cpp"
    d.mkdir(parents=True)
    shutil.copy(export["manifest"], d / "manifest.json")
    tokens = [0] * (BATCH * TOKENS)
    _refused(_run_ranks(runner, export, tokens, tmp_path / "x", manifest=d / "manifest.json"),
             f"manifest {d / 'manifest.json'} is not signed ({d / 'manifest.sig'} is missing)")
    _refused(_run_ranks(runner, export, tokens, tmp_path / "x", manifest=d / "manifest.json",
                        extra=("--allow-unsigned",)),
             f"says it was signed but its signature {d / 'manifest.sig'} is missing")


def test_a_package_that_does_not_match_the_manifest_is_refused(runner, export, tmp_path):
    """The store's package replaced by other bytes (one bit flipped): every rank refuses it by name, with both
    digests, and loads nothing."""
    packages = tmp_path / "forwards"
    shutil.copytree(export["forwards"], packages)
    [package] = packages.glob("*.pt2")
    data = bytearray(package.read_bytes())
    data[-1] ^= 1
    package.write_bytes(bytes(data))
    want = json.loads(export["manifest"].read_text())["forwards"][0]["sha256"]
    _refused(_run_ranks(runner, export, [0] * (BATCH * TOKENS), tmp_path / "x", packages=packages),
             f"{package}: sha256 {hashlib.sha256(data).hexdigest()} does not match the manifest's {want}; "
             "refusing to load it")


def test_a_package_swapped_after_the_check_is_not_what_runs(runner, export, tmp_path):
    """Rank 0 checks its package and waits for rank 1; meanwhile its store file becomes bytes that cannot load.
    Rank 0 runs the private copy it hashed, never the store's file again, and gives eager's logits. (The key is
    given as KILN_VERIFY_KEY, base64 of its raw bytes, here.)"""
    mine = tmp_path / "forwards"
    shutil.copytree(export["forwards"], mine)
    [package] = mine.glob("*.pt2")
    tokens = [(7 * i + 3) % export["cfg"].vocab_size for i in range(BATCH * TOKENS)]
    out, port = tmp_path / "logits-{rank}.f32", free_port()
    env = {**RUNNER_ENV, "KILN_VERIFY_KEY": base64.b64encode(export["key"].public_key().public_bytes_raw()).decode()}

    def rank(r: int, packages: Path) -> subprocess.Popen:
        return subprocess.Popen(runner_command(runner, export["manifest"], packages, f"{BATCH}x{TOKENS}", tokens, out,
                                               r, 2, port), stderr=subprocess.PIPE, text=True, env=env)

    first = rank(0, mine)
    watchdog = threading.Timer(120, first.kill)
    watchdog.start()
    seen = ""
    while "sha256 ok; loading its private copy" not in seen:
        line = first.stderr.readline()
        assert line, f"rank 0 ended before checking its package: {seen[-2000:]}"
        seen += line
    package.write_bytes(b"not a package: whatever the store holds now is never opened again")
    second = rank(1, export["forwards"])
    _, err1 = second.communicate(timeout=300)
    err0 = seen + first.communicate(timeout=300)[1]
    watchdog.cancel()
    assert first.returncode == 0 and second.returncode == 0, (err0[-2000:], err1[-2000:])
    got = np.fromfile(str(out).format(rank=0), dtype="<f4").reshape(BATCH, TOKENS, -1)
    assert float(np.abs(got - _eager_logits(export, tokens)).max()) < 1e-4


def test_a_forward_for_another_cpu_is_refused_by_name(runner, export, tmp_path):
    """A forward compiled for another machine is refused before any rank connects, naming it, its target and
    this host's machine."""
    machine = platform.machine()
    other = "riscv64" if machine != "riscv64" else "x86_64"
    target = f"cpu-{other}-default-00000000"
    manifest = _resigned(export, tmp_path / "exports" / "cpp", lambda m: m["forwards"][0].update(target=target))
    key = json.loads(manifest.read_text())["forwards"][0]["key"]
    _refused(_run_ranks(runner, export, [0] * (BATCH * TOKENS), tmp_path / "x", manifest=manifest),
             f"no forward of bucket {BATCH}x{TOKENS} can run on this host; forward {key}: it was compiled for "
             f"target {target} (machine {other}) and this host's machine is {machine}")


def test_a_cuda_export_is_refused_by_name(runner, export, tmp_path):
    """The runner runs CPU packages only: a manifest whose runtime device is cuda stops before any package
    or weight is read, saying so (the package here is a CPU one; the device is what is refused)."""
    manifest = _resigned(export, tmp_path / "exports" / "cpp", lambda m: m["runtime"].update(device="cuda"))
    _refused(_run_ranks(runner, export, [0] * (BATCH * TOKENS), tmp_path / "x", manifest=manifest),
             "run on cuda; this runner runs CPU packages only")


def test_cpp_runner_runs_what_kiln_export_wrote(runner, tp2_export, dev_verify_key, tmp_path):
    """The manifest and packages of a real `kiln export --tp 2` are enough for the runner, at every checked
    shape of every forward's range (the runner picks the forward by the consumer contract's rule): its signature, made
    by Kiln over a real manifest (floats and all), verifies from the stored bytes."""
    import torch

    from kiln.core.model.config import ModelConfig
    from kiln.host.weights.checkpoint import load_rank_weights
    from kiln.host.model import ShardedDecoder

    root = Path(tp2_export["store"].removeprefix("file://"))
    r = tp2_export["cold_report"]
    manifest = json.loads((root / r["manifest"]).read_text())
    cfg = ModelConfig(**manifest["model"]["config"])
    eager = ShardedDecoder(cfg, 1).eval()
    eager.load_state_dict(load_rank_weights(manifest["model"]["checkpoint"], cfg, 1, 0))
    from kiln.core.forwards.shape_ranges import parse_shape_range

    for f, (batch, tokens) in [(f, (c.batch, c.tokens)) for f in manifest["forwards"]
                               for c in parse_shape_range(f["shapes"]).checked_shapes()]:
        bucket = f"{batch}x{tokens}"
        ids = [(7 * i + 3) % cfg.vocab_size for i in range(batch * tokens)]
        port = free_port()
        out = tmp_path / f"{bucket}-{{rank}}.f32"
        procs = [subprocess.Popen(runner_command(runner, root / r["manifest"], root / "forwards", bucket, ids, out,
                                                 rank, 2, port, ("--verify-key", str(dev_verify_key))),
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=RUNNER_ENV)
                 for rank in range(2)]
        for rank, p in enumerate(procs):
            _, err = p.communicate(timeout=300)
            assert p.returncode == 0, f"{bucket} rank {rank}: {err[-3000:]}"
            assert f"forward {f['key']} ({f['shapes']}) for {bucket}" in err, err[-2000:]
            assert f"signature ok: signed by {manifest['signing']['key_fingerprint']}" in err, err[-2000:]
        pages_per_seq = next(i for i in f["interface"]["inputs"] if i["name"] == "block_table")["shape"][1]
        page_tokens = manifest["recipe"]["page_tokens"]
        cache = torch.zeros(cfg.num_layers, 2, pages_per_seq * batch + 1, page_tokens, cfg.num_kv_heads, cfg.head_dim)
        table = torch.arange(batch * pages_per_seq).reshape(batch, pages_per_seq)
        with torch.no_grad():
            want = eager(torch.tensor(ids).reshape(batch, tokens), torch.zeros(batch, dtype=torch.long), cache,
                         table)[0].numpy()
        for rank in range(2):
            got = np.fromfile(str(out).format(rank=rank), dtype="<f4").reshape(want.shape)
            assert float(np.abs(got - want).max()) < 1e-4 * max(1.0, float(np.abs(want).max())), (bucket, rank)
