"""A checkpoint's fingerprint is its content, read once per file version (kiln.host.weights.checkpoint)."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file

from kiln.host.machine import cache
from kiln.host.weights.checkpoint import checkpoint_fingerprint


def _checkpoint(path, seed: int):
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    g = torch.Generator().manual_seed(seed)
    save_file({"w": torch.randn(16, 8, generator=g), "b": torch.randn(8, generator=g)}, str(path / "model.safetensors"))
    return path


def _same_names_sizes_mtimes(a, b):
    for f in a.iterdir():
        assert (b / f.name).stat().st_size == f.stat().st_size
        st = f.stat()
        os.utime(b / f.name, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_other_weights_with_the_same_names_sizes_and_mtimes_differ(tmp_path):
    a, b = _checkpoint(tmp_path / "a", seed=0), _checkpoint(tmp_path / "b", seed=1)
    _same_names_sizes_mtimes(a, b)  # what `rsync -a` of other weights of the same shapes leaves
    digests = tmp_path / "cache" / "digests"
    assert checkpoint_fingerprint(a, digests) != checkpoint_fingerprint(b, digests)
    assert checkpoint_fingerprint(a) != checkpoint_fingerprint(b)
    c = _checkpoint(tmp_path / "c", seed=0)  # the same content elsewhere is the same checkpoint
    assert checkpoint_fingerprint(c, digests) == checkpoint_fingerprint(a, digests)


def test_a_second_call_reads_no_file_and_a_rewrite_is_read_again(tmp_path, monkeypatch):
    a = _checkpoint(tmp_path / "a", seed=0)
    digests = tmp_path / "digests"
    reads = []
    real = cache.sha256_file
    monkeypatch.setattr(cache, "sha256_file", lambda p: reads.append(p.name) or real(p))
    first = checkpoint_fingerprint(a, digests)
    assert sorted(reads) == ["config.json", "model.safetensors"]
    reads.clear()
    assert checkpoint_fingerprint(a, digests) == first and reads == []  # remembered: nothing read

    # Other weights written in place with the old size and mtime restored (rsync --inplace -a): read again.
    weights = a / "model.safetensors"
    st = weights.stat()
    other = _checkpoint(tmp_path / "other", seed=1) / "model.safetensors"
    with open(weights, "r+b") as f:
        f.write(other.read_bytes())
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (weights.stat().st_size, weights.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    assert checkpoint_fingerprint(a, digests) != first and reads == ["model.safetensors"]


def test_a_corrupt_digest_record_is_read_again(tmp_path):
    a = _checkpoint(tmp_path / "a", seed=0)
    digests = tmp_path / "digests"
    first = checkpoint_fingerprint(a, digests)
    for record in digests.iterdir():
        record.write_text('{"sha2')
    assert checkpoint_fingerprint(a, digests) == first
