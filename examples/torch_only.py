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
        --checkpoint CKPT --rank R --world-size 2 --port 29511 --out OUT_DIR --verify-key KEY.pub

Rank R writes OUT_DIR/rank{R}.pt: {bucket: logits} (torch.save). The tokens
of bucket BxT are `(arange(B*T) * 7 + 3) % vocab`, reshaped to [B, T].

A package is native code, so before it loads anything, and before any rank
connects, each rank checks what it was given as `kiln verify` does: the
manifest's Ed25519 signature (`manifest.sig` beside it) with the keys of
`--verify-key FILE` (repeatable) and `KILN_VERIFY_KEY` (PEM, base64, or a file
holding either; `--allow-unsigned` accepts a manifest exported `--unsigned`),
that each forward it runs was compiled for this machine and an ISA level this
CPU has (or this GPU's arch), and each package's sha256, hashed while the
package is copied into a private directory: the copy is what it loads, so the
bytes hashed are the bytes run. The signature needs the `cryptography`
package (a consumer that cannot check the signature would load whatever the
store holds); everything else is torch and the standard library.
"""

from __future__ import annotations

import argparse
import base64
import binascii
import hashlib
import inspect
import json
import mmap
import os
import platform
import re
import shutil
import struct
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist

try:
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
except ImportError:
    raise SystemExit("examples/torch_only.py checks the manifest's Ed25519 signature with the `cryptography` "
                     "package, which is not installed: pip install cryptography") from None

SAFETENSORS_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64,
                      "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
                      "U8": torch.uint8, "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn,
                      "F8_E8M0": torch.uint8}  # UE8M0 scales: their bytes, which the package takes as uint8


# ------------------------------------------------------------------ what is checked before anything loads

DOMAIN = b"kiln-manifest-v1\n"
"""What Kiln signs is DOMAIN + the manifest's canonical JSON (`canonical_bytes`)."""


def canonical_bytes(manifest: dict) -> bytes:
    body = json.dumps(manifest, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)
    return DOMAIN + body.encode("ascii")


def fingerprint(key: Ed25519PublicKey) -> str:
    """'ed25519:' + the first 32 hex digits of sha256 of the key's 32 raw bytes: how Kiln names a key."""
    return "ed25519:" + hashlib.sha256(key.public_bytes_raw()).hexdigest()[:32]


def _base64_32(line: str) -> bytes | None:
    try:
        raw = base64.b64decode("".join(line.split()), validate=True)
    except (binascii.Error, ValueError):
        return None
    return raw if len(raw) == 32 else None


def _base64_lines(text: str) -> list[str]:
    return [line.strip() for line in text.replace(",", "\n").splitlines()
            if line.strip() and not line.strip().startswith("#")]


def public_keys(text: str, source: str) -> list[Ed25519PublicKey]:
    """Every Ed25519 public key in `text`: PEM blocks ("BEGIN PUBLIC KEY"), or base64 of the 32 raw bytes, one a
    line or comma-separated. SystemExit naming `source` for anything else."""
    keys = []
    if "-----BEGIN" in text:
        for block in re.finditer(r"-----BEGIN ([A-Z0-9 ]+)-----.+?-----END \1-----", text, re.S):
            if "PRIVATE KEY" in block.group(1):
                raise SystemExit(f"{source} holds a private key; give this script the public key only")
            try:
                key = serialization.load_pem_public_key(block.group(0).encode())
            except ValueError:
                key = None
            if not isinstance(key, Ed25519PublicKey):
                raise SystemExit(f"{source} holds a PEM block that is not an Ed25519 public key")
            keys.append(key)
    else:
        for line in _base64_lines(text):
            raw = _base64_32(line)
            if raw is None:
                raise SystemExit(f"{source} is neither PEM nor base64 of 32-byte Ed25519 public keys")
            keys.append(Ed25519PublicKey.from_public_bytes(raw))
    if not keys:
        raise SystemExit(f"{source} holds no public key")
    return keys


def trusted_keys(files: list[Path], env_value: str) -> dict[str, Ed25519PublicKey]:
    """fingerprint -> key of each --verify-key FILE and of KILN_VERIFY_KEY (`env_value`: the key itself, PEM or
    base64, else the path of a file holding it), as `kiln verify` reads them."""
    keys = []
    for f in files:
        keys += public_keys(f.read_text(), f"--verify-key {f}")
    value = env_value.strip()
    if value:
        looks_like_keys = "-----BEGIN" in value or all(_base64_32(line) for line in _base64_lines(value))
        if not looks_like_keys and Path(value).expanduser().is_file():
            value = Path(value).expanduser().read_text()
        keys += public_keys(value, "KILN_VERIFY_KEY")
    return {fingerprint(k): k for k in keys}


def read_verified_manifest(path: Path, keys: dict[str, Ed25519PublicKey], allow_unsigned: bool) -> tuple[dict, str]:
    """The manifest at `path` (read once) after its signature, `manifest.sig` beside it, verified with one of
    `keys`: (manifest, what was checked). SystemExit naming the signature and the key otherwise."""
    manifest = json.loads(path.read_bytes())
    sig_path = path.parent / "manifest.sig"
    what = f"manifest {path}"
    if not sig_path.exists():
        if not allow_unsigned:
            raise SystemExit(f"{what} is not signed ({sig_path} is missing); refusing to load anything from it. "
                             "Pass --allow-unsigned only if it was exported with --unsigned on purpose.")
        if manifest.get("signing", {}).get("signed") is not False:
            raise SystemExit(f"{what} says it was signed but its signature {sig_path} is missing; refusing it.")
        return manifest, "signature: none (unsigned export accepted because of --allow-unsigned)"
    sig = json.loads(sig_path.read_bytes())
    fields = ("key_fingerprint", "public_key", "manifest_sha256", "signature")
    if (not isinstance(sig, dict) or sig.get("kiln_signature") != 1 or sig.get("algorithm") != "ed25519"
            or not all(isinstance(sig.get(f), str) for f in fields)):
        raise SystemExit(f"the signature {sig_path} of {what} is malformed; refusing it.")
    fp = sig["key_fingerprint"]
    if not keys:
        raise SystemExit(f"no key to check the signature {sig_path} of {what} with (it names key {fp}): pass "
                         "--verify-key FILE (the .pub that `kiln keygen` wrote) or set KILN_VERIFY_KEY.")
    if fp not in keys:
        raise SystemExit(f"{what} is signed by key {fp} ({sig_path}), which is not a trusted verify key (trusted: "
                         f"{', '.join(sorted(keys))}); refusing it. Pass the signer's public key with --verify-key "
                         "FILE or KILN_VERIFY_KEY if you trust it.")
    data = canonical_bytes(manifest)
    try:
        keys[fp].verify(base64.b64decode(sig["signature"], validate=True), data)
    except (InvalidSignature, binascii.Error, ValueError):
        changed = hashlib.sha256(data).hexdigest() != sig["manifest_sha256"]
        raise SystemExit(f"the signature {sig_path} of {what} does not verify with key {fp}: "
                         + ("the manifest was changed after it was signed" if changed else "the signature was changed")
                         + "; refusing it.") from None
    if manifest.get("signing", {}).get("key_fingerprint") != fp:
        raise SystemExit(f"{what} names another signing key than the one that signed it ({fp}); refusing it.")
    return manifest, f"signature ok: signed by {fp}"


def cpu_target_problem(target: str, machine: str, isa_level: str) -> str | None:
    """Why a forward compiled for CPU target `target` ('cpu-<machine>-<ISA level>-<flags hash>') cannot run on a
    `machine` (platform.machine()) whose torch CPU capability is `isa_level`, or None. Every level runs DEFAULT
    code and AVX512 runs AVX2 code (the flags behind a level: target_problem, from the manifest's target_cpu)."""
    m = re.fullmatch(r"cpu-([^-]+)-([^-]+)-[^-]+", target)
    if not m:
        return f"its target {target!r} is not a CPU target this script can check"
    their_machine, level, host_level = m.group(1), m.group(2), isa_level.lower()
    if their_machine != machine:
        return f"it was compiled for target {target} (machine {their_machine}) and this host's machine is {machine}"
    if level not in (host_level, "default") and not (level == "avx2" and host_level == "avx512"):
        return (f"it was compiled for target {target}, ISA level {level}, and this CPU's level is {host_level} "
                "(torch's CPU capability): its code would stop with an illegal instruction")
    return None


def cpu_flags() -> set[str]:
    """This CPU's instruction-set flags as /proc/cpuinfo lists them (x86 `flags`, aarch64 `Features`)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def target_problem(forward: dict, device: torch.device) -> str | None:
    """Why `forward` cannot run here, or None: a CPU forward by its machine and ISA level, and by the
    instruction-set flags its `target_cpu` lists (manifests that record it); a CUDA forward ('cuda-<sm
    arch>-...') by the arch of the rank's GPU."""
    target = str(forward.get("target"))
    if device.type == "cpu":
        problem = cpu_target_problem(target, platform.machine(), torch.backends.cpu.get_cpu_capability())
        missing = sorted(set(forward.get("target_cpu", {}).get("isa_flags", ())) - cpu_flags())
        if problem is None and missing:
            problem = (f"it was compiled for target {target}, on a CPU with instruction set(s) "
                       f"{', '.join(missing[:6])} this CPU lacks: its code would stop with an illegal instruction")
        return problem
    major, minor = torch.cuda.get_device_capability(device)
    if not target.startswith(f"cuda-sm_{major}{minor}-"):
        return f"it was compiled for target {target}, and GPU {device.index} is sm_{major}{minor}"
    return None


def private_copy(package: Path, directory: Path, sha256: str) -> Path:
    """`package` copied into `directory` (private: mkdtemp's 0700; the file 0600) while it is hashed: the copy,
    whose bytes are those hashed. SystemExit naming the package and both digests when they are not `sha256`."""
    copy = directory / package.name
    digest = hashlib.sha256()
    with open(package, "rb") as src, open(os.open(copy, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "wb") as dst:
        while chunk := src.read(1 << 20):
            digest.update(chunk)
            dst.write(chunk)
    if digest.hexdigest() != sha256:
        raise SystemExit(f"{package}: sha256 {digest.hexdigest()} does not match the manifest's {sha256}; "
                         "refusing to load it")
    return copy


# ------------------------------------------------------------------ weights, forwards, inputs

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
    allocated once and each source copied into its slice of the leading dimension, in order. Where the ranks'
    shares differ, a constant's `shapes` and a cut's `lengths` are per rank."""
    out = {}
    for name in names:
        w = manifest["weights"][name]
        shape = w["shapes"][rank] if "shapes" in w else w["shape"]
        constant = torch.empty(shape, dtype=getattr(torch, w["dtype"]), device=device)
        for i, source in enumerate(w["sources"]):
            t = tensors[source["tensor"]]
            if source["cut"] is not None:  # FP8 block scales may repeat each entry over a rank's sub-blocks first
                cut = source["cut"]
                t = t.repeat_interleave(cut.get("repeat", 1), cut["dim"]) if cut.get("repeat", 1) > 1 else t
                length = cut["lengths"][rank] if "lengths" in cut else cut["length"]
                t = t.narrow(cut["dim"], cut["offsets"][rank], length)
            (constant if w["stack"] is None else constant[i]).copy_(t)
        out[name] = constant
    return out


def holds(forward: dict, batch: int, tokens: int) -> bool:
    """Whether the forward's range (`batch` and `tokens` are [min, max]) holds the shape."""
    return (forward["batch"][0] <= batch <= forward["batch"][1]
            and forward["tokens"][0] <= tokens <= forward["tokens"][1])


def choose_forward(forwards: list[dict], batch: int, tokens: int) -> dict:
    """The forward to run `batch` sequences of `tokens` new tokens with, by the contract's rule: of those whose
    range holds the shape, the fewest shapes, then the hint nearest to it, then the smallest `shapes` name."""
    def order(f: dict) -> tuple:
        size = (f["batch"][1] - f["batch"][0] + 1) * (f["tokens"][1] - f["tokens"][0] + 1)
        return size, abs(f["hint"][0] - batch) + abs(f["hint"][1] - tokens), f["shapes"]

    fits = [f for f in forwards if holds(f, batch, tokens)]
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
    p.add_argument("--packages", type=Path, required=True,
                   help="the store's forwards/ folder: each forward is read at its manifest object under it")
    p.add_argument("--checkpoint", type=Path, required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--verify-key", type=Path, action="append", default=[],
                   help="public key (PEM or base64) trusted to sign the manifest; repeatable (and KILN_VERIFY_KEY)")
    p.add_argument("--allow-unsigned", action="store_true",
                   help="accept a manifest without manifest.sig if it says it was exported --unsigned")
    args = p.parse_args()

    manifest, chosen, device, signature_note = check_export(args)
    # Every package it will run, hashed while copied into a private directory; only the copies are loaded.
    private = Path(tempfile.mkdtemp(prefix="kiln-torch-only-"))
    try:
        forwards = {f["key"]: f for f in chosen.values()}  # a forward may serve several buckets
        copies = {key: private_copy(package_path(args.packages, f), private, f["sha256"])
                  for key, f in forwards.items()}
        print(f"rank {args.rank}: {signature_note}; sha256 ok for {len(copies)} package(s)", file=sys.stderr)
        run_buckets(args, manifest, chosen, copies, device)
    finally:
        shutil.rmtree(private, ignore_errors=True)


def package_path(packages: Path, forward: dict) -> Path:
    """Where a forward's package is under `packages` (the store's forwards/ folder): its manifest object without
    the leading 'forwards/' (<key>/<sha256>.pt2; a store written before keeps <key>.pt2)."""
    rel = Path(forward["object"].removeprefix("forwards/"))
    if rel.is_absolute() or ".." in rel.parts:
        raise SystemExit(f"forward {forward['key']}: its object {forward['object']!r} leaves the packages folder")
    return packages / rel


def check_export(args: argparse.Namespace) -> tuple[dict, dict[str, dict], torch.device, str]:
    """The verified manifest, each bucket's forward among those this host can run, the rank's device and what
    was checked of the signature; SystemExit naming what is refused, before any rank connects."""
    keys = trusted_keys(args.verify_key, os.environ.get("KILN_VERIFY_KEY", ""))
    manifest, signature_note = read_verified_manifest(args.manifest, keys, args.allow_unsigned)
    if not manifest["runtime"]["python_free"]:
        raise SystemExit("this export needs Python ops registered: not for torch alone")
    if args.world_size != manifest["tp"]:
        raise SystemExit(f"the export is tp {manifest['tp']} but --world-size is {args.world_size}")
    device = torch.device("cpu")
    if manifest["runtime"].get("device", "cpu") == "cuda":  # absent: cpu
        if not torch.cuda.is_available():
            raise SystemExit("this export's packages run on CUDA and this torch sees no GPU: run it on a GPU host")
        device = torch.device("cuda", args.rank % torch.cuda.device_count())
    # This rank's forwards (where the ranks' shares differ, each forward lists the ranks it is for), and each
    # bucket's among those this host can run; refused by name before any rank connects.
    mine = [f for f in manifest["forwards"] if args.rank in f.get("ranks", [args.rank])]
    problems = {f["key"]: target_problem(f, device) for f in mine}
    runnable = [f for f in mine if problems[f["key"]] is None]
    chosen = {}
    for bucket in manifest["buckets"]:
        batch, tokens = map(int, bucket.split("x"))
        holders = [f for f in mine if holds(f, batch, tokens)]
        if holders and all(problems[f["key"]] for f in holders):
            raise SystemExit(f"no forward of bucket {bucket} can run on this host: " + "; ".join(
                f"forward {f['key']}: {problems[f['key']]}" for f in holders))
        chosen[bucket] = choose_forward(runnable, batch, tokens)
    return manifest, chosen, device, signature_note


def run_buckets(args: argparse.Namespace, manifest: dict, chosen: dict[str, dict], copies: dict[str, Path],
                device: torch.device) -> None:
    """Join the ranks, bind this rank's constants to each checked copy and run each bucket on its forward."""
    os.environ["AOTI_RUNTIME_CHECK_INPUTS"] = "1"  # a wrong shape raises instead of returning garbage
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args.port}", rank=args.rank,
                            world_size=args.world_size)
    # The default world group is the packages'; this script's own collectives get a group of their own
    # (with gloo, host collectives on the packages' group between calls can deadlock the next call).
    mine = dist.new_group(backend="gloo")
    # The rank's constants, built once for every forward; the checkpoint's tensors are dropped after.
    names = sorted({name for forward in chosen.values() for name in forward["constants"]})
    constants = rank_constants(manifest, names, read_checkpoint(args.checkpoint), args.rank, device)
    vocab = manifest["model"]["config"]["vocab_size"]
    logits, packages = {}, {}
    for bucket, forward in chosen.items():
        batch, tokens = map(int, bucket.split("x"))
        if forward["key"] not in packages:  # each package loaded once, its constants bound before its first call
            package = torch._inductor.aoti_load_package(str(copies[forward["key"]]),
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
