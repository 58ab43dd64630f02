"""An export runs without Kiln: every package loads in a fresh interpreter with torch alone.

`examples/torch_only.py` is the consumer a user would write from the manifest
alone. It runs here as two gloo ranks in fresh interpreters in which importing
Kiln is made impossible; their logits must match Kiln's own loader (the same
packages, weights bound by kiln.host.ranks.loader.load_forward from kiln.host.weights.checkpoint) and
the unsharded eager model. Given the export changed one thing at a time (a
byte of the signed manifest, the key, a package, a target), it refuses by name
before it loads anything or joins the other rank.
"""

from __future__ import annotations

import hashlib
import json
import platform
import shutil
import sys
from pathlib import Path

import pytest
from torch_only_harness import EXAMPLE, run_torch_only, run_with_kiln, torch_only_ranks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def manifest(tp2_export) -> tuple[dict, Path, Path]:
    r = tp2_export["cold_report"]
    root = Path(tp2_export["store"].removeprefix("file://"))
    path = root / r["manifest"]
    return json.loads(path.read_text()), path, root / "forwards"


def test_manifest_states_the_consumer_contract(manifest):
    m, _, _ = manifest
    assert m["runtime"] == {"process_group": "0", "world_size": 2, "python_free": True, "device": "cpu"}
    assert m["forwards"] and all(f["python_free"] for f in m["forwards"])
    for f in m["forwards"]:
        ops = set(f["ops"])
        assert {"aoti_torch_cpu__c10d_functional_all_reduce_", "aoti_torch_cpu__c10d_functional_wait_tensor"} <= ops
        assert f["interface"]["process_group"] == "0"
        kv = next(i for i in f["interface"]["inputs"] if i["name"] == "kv_cache")
        assert "num_pages" in kv["shape"]
        assert set(f["constants"]) == set(m["weights"])
    q = m["weights"]["model.runs.0.self_attn.q_proj.weight"]
    layers = m["model"]["config"]["num_layers"]
    assert q["stack"] == layers and q["shape"][0] == layers
    assert [s["tensor"] for s in q["sources"]] == [f"model.layers.{i}.self_attn.q_proj.weight" for i in range(layers)]
    assert all(s["cut"]["dim"] == 0 and s["cut"]["offsets"] == [0, s["cut"]["length"]] for s in q["sources"])
    norm = m["weights"]["model.norm.weight"]
    assert norm["stack"] is None and norm["sources"][0]["cut"] is None


def test_every_package_runs_with_torch_alone_and_matches_kiln(manifest, dev_verify_key, tmp_path):
    import torch

    m, path, packages = manifest
    ckpt = m["model"]["checkpoint"]
    run_torch_only(path, packages, ckpt, tmp_path / "alone", verify_key=dev_verify_key)
    run_with_kiln(path, packages, tmp_path / "kiln")

    from kiln.core.model.config import ModelConfig
    from kiln.host.weights.checkpoint import load_rank_weights
    from kiln.host.model import ShardedDecoder
    sys.path.insert(0, str(EXAMPLE.parent))
    from torch_only import choose_forward, step_inputs

    cfg = ModelConfig(**m["model"]["config"])
    eager = ShardedDecoder(cfg, 1).eval()
    eager.load_state_dict(load_rank_weights(ckpt, cfg, 1, 0))
    got = [torch.load(tmp_path / "alone" / f"rank{r}.pt") for r in range(2)]
    ref = [torch.load(tmp_path / "kiln" / f"rank{r}.pt") for r in range(2)]
    assert set(got[0]) == set(m["buckets"]) and len(m["forwards"]) < len(m["buckets"])  # ranges serve them
    for b in m["buckets"]:
        batch, tokens = map(int, b.split("x"))
        f = choose_forward(m["forwards"], batch, tokens)
        # Both ranks hold the whole logits after the all-reduce; they agree with each other and with Kiln.
        assert torch.equal(got[0][b], got[1][b])
        assert float((got[0][b] - ref[0][b]).abs().max()) <= 1e-6, b
        args = step_inputs(f, cfg.vocab_size, batch, tokens)
        args[2] = torch.zeros(args[2].shape[:4] + (cfg.num_kv_heads, cfg.head_dim))  # all KV heads, empty
        with torch.no_grad():
            want = eager(*args)[0]
        assert float((got[0][b] - want).abs().max()) < 1e-4 * max(1.0, float(want.abs().max())), b


def _refused(manifest_path: Path, packages: Path, checkpoint: str, tmp_path: Path, extra: tuple,
             *messages: str) -> None:
    """Rank 0 of torch alone stops, saying each of `messages`, before it joins rank 1 (not started: it would
    wait for rank 0) or writes anything."""
    for p in torch_only_ranks(manifest_path, packages, checkpoint, tmp_path / "out", 2, extra, ranks=(0,)):
        assert p.returncode != 0 and all(m in p.stderr for m in messages), p.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_torch_alone_refuses_a_manifest_changed_after_signing(manifest, dev_verify_key, tmp_path):
    """One byte of the signed manifest changed (a forward's sha256, as if pointed at other bytes), the old
    signature kept: refused, naming the signature and its key."""
    m, path, packages = manifest
    d = tmp_path / "exports" / m["export_id"]
    d.mkdir(parents=True)
    data = path.read_bytes()
    at = data.index(b'"sha256": "') + len(b'"sha256": "')
    (d / "manifest.json").write_bytes(data[:at] + (b"0" if data[at:at + 1] != b"0" else b"1") + data[at + 1:])
    shutil.copy(path.with_name("manifest.sig"), d / "manifest.sig")
    _refused(d / "manifest.json", packages, m["model"]["checkpoint"], tmp_path, ("--verify-key", str(dev_verify_key)),
             f"the signature {d / 'manifest.sig'} of manifest {d / 'manifest.json'} does not verify with key "
             f"{m['signing']['key_fingerprint']}: the manifest was changed after it was signed")


def test_torch_alone_refuses_an_untrusted_key_and_no_key(manifest, tmp_path):
    from kiln.core.trust.signing import fingerprint, generate, public_pem

    m, path, packages = manifest
    other = generate().public_key()
    (tmp_path / "other.pub").write_bytes(public_pem(other))
    _refused(path, packages, m["model"]["checkpoint"], tmp_path, ("--verify-key", str(tmp_path / "other.pub")),
             f"is signed by key {m['signing']['key_fingerprint']} ({path.with_name('manifest.sig')}), which is not a "
             f"trusted verify key (trusted: {fingerprint(other)})")
    _refused(path, packages, m["model"]["checkpoint"], tmp_path, (),
             f"no key to check the signature {path.with_name('manifest.sig')} of manifest {path}")


def test_torch_alone_refuses_a_package_that_does_not_match_the_manifest(manifest, dev_verify_key, tmp_path):
    """The store's file of a forward replaced by another real package of the export (with its own correct
    digest): refused by name with both digests, nothing loaded."""
    m, path, packages = manifest
    mine = tmp_path / "forwards"
    shutil.copytree(packages, mine)  # the files themselves, not the store's symlinks
    first, second = sorted(m["forwards"], key=lambda f: f["key"])[:2]
    victim = mine / first["object"].removeprefix("forwards/")
    shutil.copy(mine / second["object"].removeprefix("forwards/"), victim)
    got = hashlib.sha256(victim.read_bytes()).hexdigest()
    _refused(path, mine, m["model"]["checkpoint"], tmp_path, ("--verify-key", str(dev_verify_key)),
             f"{victim}: sha256 {got} does not match the manifest's {first['sha256']}; refusing to load it")


def test_torch_alone_refuses_a_forward_for_another_cpu(manifest, tmp_path):
    """Every forward's target names another machine (the manifest signed again, by a key of the test's):
    refused before any rank connects, naming a bucket, the forward, its target and this host's machine."""
    from kiln.core.trust.signing import fingerprint, generate, public_pem, sign_manifest
    from kiln.store.base import json_bytes

    m, path, packages = manifest
    machine = platform.machine()
    other = "riscv64" if machine != "riscv64" else "x86_64"
    key = generate()
    changed = json.loads(json.dumps(m))
    for f in changed["forwards"]:
        f["target"] = f"cpu-{other}-default-00000000"
    changed["signing"]["key_fingerprint"] = fingerprint(key.public_key())
    d = tmp_path / "exports" / m["export_id"]
    d.mkdir(parents=True)
    (d / "manifest.json").write_bytes(json_bytes(changed))
    (d / "manifest.sig").write_bytes(json_bytes(sign_manifest(changed, key)))
    (tmp_path / "key.pub").write_bytes(public_pem(key.public_key()))
    _refused(d / "manifest.json", packages, m["model"]["checkpoint"], tmp_path,
             ("--verify-key", str(tmp_path / "key.pub")),
             f"no forward of bucket {m['buckets'][0]} can run on this host",
             f"it was compiled for target cpu-{other}-default-00000000 (machine {other}) and this host's machine is "
             f"{machine}")
