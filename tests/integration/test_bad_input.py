"""Bad input: exit code 2, a clear message, no traceback, nothing written to the store.

Each case runs `cli.main.main(argv)` in this process (`kiln_main`): these refusals come before Prefect
starts, so a subprocess would add only torch's import. One case runs `kiln` as a subprocess, so exit
code 2 stays proven through the real entry point.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def _check_refused(run, store: Path, *needles: str) -> None:
    assert run.code == 2, (run.code, run.err[-2000:])
    assert "Traceback" not in run.err
    for needle in needles:
        assert needle in run.err, run.err
    assert not store.exists() or not any(p.is_file() for p in store.rglob("*"))


@pytest.fixture
def ckpt(kiln_main, tmp_path) -> Path:
    d = tmp_path / "ckpt"
    run = kiln_main("checkpoint", str(d), "--layers", "1", "--hidden", "64", "--heads", "4", "--kv-heads", "2",
               "--head-dim", "16", "--intermediate", "128", "--vocab", "128", "--shards", "2")
    assert run.code == 0, run.err
    return d


def export(run_kiln, tmp_path, *args):
    store = tmp_path / "store"
    return run_kiln("export", "--store", f"file://{store}", *args), store


def test_missing_checkpoint_dir(kiln, tmp_path):
    """The subprocess case: `python -m cli.main` exits 2 for bad input, as a user sees it."""
    run, store = export(kiln, tmp_path, "--model", str(tmp_path / "nope"))
    _check_refused(run, store, "does not exist")


def test_corrupt_safetensors_header(kiln_main, tmp_path, ckpt):
    shard = sorted(ckpt.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[8:16] = b"{garbage"
    shard.write_bytes(bytes(data))
    run, store = export(kiln_main, tmp_path, "--model", str(ckpt))
    _check_refused(run, store, shard.name, "corrupt")


def test_truncated_safetensors(kiln_main, tmp_path, ckpt):
    shard = sorted(ckpt.glob("*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    run, store = export(kiln_main, tmp_path, "--model", str(ckpt))
    _check_refused(run, store, shard.name)


def test_shapes_not_matching_config(kiln_main, tmp_path, ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["intermediate_size"] = 96
    (ckpt / "config.json").write_text(json.dumps(cfg))
    run, store = export(kiln_main, tmp_path, "--model", str(ckpt))
    _check_refused(run, store, "does not match its config")


def test_more_ranks_than_heads_is_refused_naming_what_works(kiln_main, tmp_path):
    run, store = export(kiln_main, tmp_path, "--model", "tiny", "--tp", "25")
    _check_refused(run, store, "--tp 25 cannot split the model: it has 24 attention heads, fewer than 25 ranks")


@pytest.mark.parametrize("spec", ["1x16,4", "0x16", "ax3"])
def test_malformed_buckets(kiln_main, tmp_path, spec):
    run, store = export(kiln_main, tmp_path, "--model", "tiny", "--buckets", spec)
    _check_refused(run, store, "BATCHxTOKENS")


@pytest.mark.parametrize("setting", ["worker_host_mib=0", "headroom_floor_mib=-1", "worker_device_mib=-2048"])
def test_non_positive_memory_settings(kiln_main, tmp_path, setting):
    run, store = export(kiln_main, tmp_path, "--model", "tiny", "--set", setting)
    _check_refused(run, store, setting.split("=")[0])


def test_a_cuda_export_on_a_host_without_a_gpu_is_refused_before_prefect(kiln_main, tmp_path):
    """This machine has no GPU (the gpu tests do the export itself on one): device=cuda stops at the probe,
    before the flow starts, naming the host and the way out."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU: device=cuda is not refused here (tests/integration/test_cuda_export.py)")
    run, store = export(kiln_main, tmp_path, "--model", "tiny", "--set", "device=cuda")
    _check_refused(run, store, "device=cuda but", "has no GPU", "--set device=cpu")


def test_unknown_setting_lists_known_ones(kiln_main, tmp_path):
    run, store = export(kiln_main, tmp_path, "--model", "tiny", "--set", "headroom=1")
    _check_refused(run, store, "headroom_floor_mib")


def test_unknown_store_scheme(kiln_main, tmp_path):
    run = kiln_main("export", "--model", "tiny", "--store", "ftp://host/x")
    assert run.code == 2 and "unknown store scheme 'ftp'" in run.err and "Traceback" not in run.err


def test_bad_assume_available(kiln_main, tmp_path):
    run, store = export(kiln_main, tmp_path, "--model", "tiny", "--assume-available", "nohost=100")
    _check_refused(run, store, "unknown host")


def test_dask_without_prefect_server_is_bad_input(kiln_main):
    run = kiln_main("export", "--dask", "tcp://127.0.0.1:1", "--tp", "2")
    assert run.code == 2 and "PREFECT_API_URL" in run.err


def test_unreachable_prefect_server_is_bad_input(kiln_main):
    # Port 1 on loopback: privileged, nothing listens there.
    run = kiln_main("export", "--tp", "2", env={"PREFECT_API_URL": "http://127.0.0.1:1/api"})
    assert run.code == 2 and "cannot reach the Prefect server" in run.err


def _rewrite_header(shard: Path, edit) -> None:
    """Rewrite `shard`'s JSON header as `edit(header)` returns it (the data section kept as it was)."""
    data = shard.read_bytes()
    length = int.from_bytes(data[:8], "little")
    header = json.dumps(edit(json.loads(data[8:8 + length]))).encode()
    shard.write_bytes(len(header).to_bytes(8, "little") + header + data[8 + length:])


def _first_tensor(header: dict) -> str:
    return sorted(n for n in header if n != "__metadata__")[0]


@pytest.mark.parametrize("entry", ["../outside.safetensors", "ABSOLUTE", 7],
                         ids=["dotdot", "absolute", "non-string"])
def test_an_index_entry_outside_the_checkpoint_or_not_a_string_is_refused(kiln_main, tmp_path, ckpt, entry):
    """The index's file names are untrusted: one that leaves the directory (to a readable safetensors file,
    so only the name is wrong) or is not a string is refused, naming the index and the entry."""
    index = ckpt / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    name, shard = sorted(raw["weight_map"].items())[0]
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes((ckpt / shard).read_bytes())
    raw["weight_map"][name] = str(outside) if entry == "ABSOLUTE" else entry
    index.write_text(json.dumps(raw))
    run, store = export(kiln_main, tmp_path, "--model", str(ckpt))
    _check_refused(run, store, str(index), repr(name), "not a file name inside the checkpoint directory")


def test_a_huge_header_length_is_refused_before_it_is_read(kiln_main, tmp_path, ckpt):
    shard = sorted(ckpt.glob("*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[:8] = (1 << 62).to_bytes(8, "little")
    shard.write_bytes(bytes(data))
    run, store = export(kiln_main, tmp_path, "--model", str(ckpt))
    _check_refused(run, store, shard.name, f"its header claims {1 << 62} bytes")


@pytest.mark.parametrize("case", ["offsets", "fp8", "unknown-dtype"])
def test_a_header_entry_that_does_not_fit_its_bytes_or_dtype_is_refused(kiln_main, tmp_path, ckpt, case):
    """data_offsets that do not span shape x dtype, an FP8 dtype Kiln does not read (F8_E5M2, refused by name;
    F8_E4M3 is an FP8-block checkpoint's) and a dtype safetensors does not define: each names the file, the
    tensor and the field."""
    shard = sorted(ckpt.glob("*.safetensors"))[0]
    names = []

    def edit(header: dict) -> dict:
        name = _first_tensor(header)
        names.append(name)
        if case == "offsets":
            begin, end = header[name]["data_offsets"]
            header[name]["data_offsets"] = [begin, end - 2]
        else:
            header[name]["dtype"] = "F8_E5M2" if case == "fp8" else "Q4_K"
        return header

    _rewrite_header(shard, edit)
    field = {"offsets": "data_offsets", "fp8": "dtype F8_E5M2", "unknown-dtype": "dtype 'Q4_K'"}[case]
    run, store = export(kiln_main, tmp_path, "--model", str(ckpt))
    _check_refused(run, store, shard.name, repr(names[0]), field)


def test_plan_refuses_an_index_entry_outside_the_checkpoint(kiln_main, tmp_path, ckpt):
    """`kiln plan` inspects the checkpoint as export does: the same refusal, exit 2."""
    index = ckpt / "model.safetensors.index.json"
    raw = json.loads(index.read_text())
    name = sorted(raw["weight_map"])[0]
    raw["weight_map"][name] = "../../x.safetensors"
    index.write_text(json.dumps(raw))
    run = kiln_main("plan", "--model", str(ckpt))
    assert run.code == 2 and "Traceback" not in run.err, run.err
    assert str(index) in run.err and "'../../x.safetensors'" in run.err, run.err
