"""Run one step of every bucket of a Kiln export with torch alone: no Kiln, no Python op registered.

A worked example of the manifest's consumer contract (docs/run-without-kiln.md).
Every rank of the export runs this script; they join one gloo group, whose
default world group is the process group the packages' collectives name
(`runtime.process_group`, "0"). Each rank reads its tensors straight from
the checkpoint's safetensors files (a short reader below), cuts and stacks
them as `weights` says (the decoder layers' tensors are stacked along a
leading layer dimension), binds them to each package before its first call,
and runs one prefill step with an empty paged KV cache (DeepSeek-V4: an empty
slot of its compressed state per sequence, `slots` naming it) at each of the export's
buckets, on the forward whose range of shapes holds it (`choose_forward`: the
contract's rule for choosing among several), on the device the manifest names
(`runtime.device`: 'cpu', or 'cuda' with rank R on GPU R mod the GPUs visible):

    python examples/torch_only.py --manifest M.json --packages STORE/forwards \\
        --checkpoint CKPT --rank R --world-size 2 --port 29511 --out OUT_DIR

Rank R writes OUT_DIR/rank{R}.pt: {bucket: logits} (torch.save). The tokens
of bucket BxT are `(arange(B*T) * 7 + 3) % vocab`, reshaped to [B, T].
"""

from __future__ import annotations

import argparse
import inspect
import json
import mmap
import os
import struct
from pathlib import Path

import torch
import torch.distributed as dist

SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool}


def read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of one safetensors file: an 8-byte little-endian header length, a JSON header
    {name: {dtype, shape, data_offsets: [begin, end]}}, then the raw bytes (offsets count from there)."""
    with open(path, "rb") as f:
        data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + length])
    base = 8 + length
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        raw = bytearray(data[base + begin:base + end])  # a copy: the tensor outlives the map
        dtype = SAFETENSORS_DTYPES[info["dtype"]]
        out[name] = (torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)).reshape(info["shape"])
    return out


def read_checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of a Hugging Face checkpoint: the files an index names, or every *.safetensors."""
    index = directory / "model.safetensors.index.json"
    files = (sorted({directory / f for f in json.loads(index.read_text())["weight_map"].values()})
             if index.exists() else sorted(directory.glob("*.safetensors")))
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        tensors.update(read_safetensors(file))
    return tensors


def rank_constants(manifest: dict, names, tensors: dict[str, torch.Tensor], rank: int,
                   device: torch.device) -> dict:
    """The package constants `names` of `rank` on `device`, as the manifest's `weights` says: each source tensor
    cut for the rank and cast to the dtype the package was compiled for; a stacked constant (`stack` not None) is
    allocated once and each source copied into its slice of the leading dimension, in order."""
    out = {}
    for name in names:
        w = manifest["weights"][name]
        constant = torch.empty(w["shape"], dtype=getattr(torch, w["dtype"]), device=device)
        for i, source in enumerate(w["sources"]):
            t = tensors[source["tensor"]]
            if source["cut"] is not None:
                t = t.narrow(source["cut"]["dim"], source["cut"]["offsets"][rank], source["cut"]["length"])
            (constant if w["stack"] is None else constant[i]).copy_(t)
        out[name] = constant
    return out


def choose_forward(forwards: list[dict], batch: int, tokens: int) -> dict:
    """The forward to run `batch` sequences of `tokens` new tokens with, by the contract's rule: of those whose
    range holds the shape (`batch` and `tokens` are [min, max]), the fewest shapes, then the hint nearest to
    it, then the smallest `shapes` name."""
    def holds(f: dict) -> bool:
        return f["batch"][0] <= batch <= f["batch"][1] and f["tokens"][0] <= tokens <= f["tokens"][1]

    def order(f: dict) -> tuple:
        size = (f["batch"][1] - f["batch"][0] + 1) * (f["tokens"][1] - f["tokens"][0] + 1)
        return size, abs(f["hint"][0] - batch) + abs(f["hint"][1] - tokens), f["shapes"]

    fits = [f for f in forwards if holds(f)]
    if not fits:
        raise SystemExit(f"no forward of this export takes {batch}x{tokens}")
    return min(fits, key=order)


def step_inputs(forward: dict, vocab: int, batch: int, tokens: int,
                device: torch.device = torch.device("cpu")) -> list[torch.Tensor]:
    """One prefill step of `batch` x `tokens` from position 0 with an empty cache on `device`, shaped as the
    forward's interface says (a dimension named there is dynamic: 'batch' and 'tokens' are the step's)."""
    spec = {i["name"]: i for i in forward["interface"]["inputs"]}
    ids = (torch.arange(batch * tokens) * 7 + 3).remainder(vocab).reshape(batch, tokens)
    if "slots" in spec:  # a slot cache (DeepSeek-V4's): one slot of state per sequence, sequence b's is slot b
        slot_values = spec["kv_cache"]["shape"][1]
        inputs = [ids, torch.zeros(batch, dtype=torch.int64),
                  torch.zeros(batch + 1, slot_values, dtype=getattr(torch, spec["kv_cache"]["dtype"])),
                  torch.arange(batch)]
        return [t.to(device) for t in inputs]
    pages_per_seq = spec["block_table"]["shape"][1]
    num_pages = pages_per_seq * batch + 1
    kv_shape = [num_pages if d == "num_pages" else d for d in spec["kv_cache"]["shape"]]
    inputs = [ids, torch.zeros(batch, dtype=torch.int64),
              torch.zeros(kv_shape, dtype=getattr(torch, spec["kv_cache"]["dtype"])),
              torch.arange(batch * pages_per_seq).remainder(num_pages).reshape(batch, pages_per_seq)]
    if "seq_lens" in spec:  # a rope that goes by the sequence's length: these prompts are `tokens` long
        inputs.append(torch.full((batch,), tokens, dtype=torch.int64))
    return [t.to(device) for t in inputs]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--manifest", type=Path, required=True)
    p.add_argument("--packages", type=Path, required=True, help="folder holding <key>.pt2")
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()

    manifest = json.loads(args.manifest.read_text())
    assert manifest["runtime"]["python_free"], "this export needs Python ops registered: not for torch alone"
    assert args.world_size == manifest["tp"]
    device = torch.device("cpu")
    if manifest["runtime"].get("device", "cpu") == "cuda":  # absent: cpu
        if not torch.cuda.is_available():
            raise SystemExit("this export's packages run on CUDA and this torch sees no GPU: run it on a GPU host")
        device = torch.device("cuda", args.rank % torch.cuda.device_count())
    os.environ["AOTI_RUNTIME_CHECK_INPUTS"] = "1"  # a wrong shape raises instead of returning garbage
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world_size)
    # The default world group is the packages'; this script's own collectives get a group of their own
    # (with gloo, host collectives on the packages' group between calls can deadlock the next call).
    mine = dist.new_group(backend="gloo")
    # The rank's constants, built once for every forward; the checkpoint's tensors are dropped after.
    names = sorted({name for forward in manifest["forwards"] for name in forward["constants"]})
    constants = rank_constants(manifest, names, read_checkpoint(args.checkpoint), args.rank, device)
    vocab = manifest["model"]["config"]["vocab_size"]
    logits, packages = {}, {}
    for bucket in manifest["buckets"]:
        batch, tokens = map(int, bucket.split("x"))
        forward = choose_forward(manifest["forwards"], batch, tokens)
        if forward["key"] not in packages:  # each package loaded once, its constants bound before its first call
            package = torch._inductor.aoti_load_package(str(args.packages / f"{forward['key']}.pt2"),
                                                        device_index=-1 if device.index is None else device.index)
            bound = {name: constants[name] for name in forward["constants"]}
            # user_managed: the package reads these tensors where they are (torch >= 2.8), so every package
            # shares one copy of the rank's weights; they must outlive the package (`constants` does).
            shared = "user_managed" in inspect.signature(package.load_constants).parameters
            package.load_constants(bound, check_full_update=True, **({"user_managed": True} if shared else {}))
            packages[forward["key"]] = package
        with torch.no_grad():
            out = packages[forward["key"]](*step_inputs(forward, vocab, batch, tokens, device))
        logits[bucket] = out[0].cpu()
    dist.barrier(group=mine)
    dist.destroy_process_group()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.save(logits, args.out / f"rank{args.rank}.pt")


if __name__ == "__main__":
    main()
