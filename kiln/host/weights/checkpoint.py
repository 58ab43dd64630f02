"""Hugging Face-layout checkpoints: `config.json` plus `*.safetensors` shards.

`inspect_checkpoint` reads only headers (cheap: run before any expensive work)
and refuses missing files, an index naming files outside the directory,
corrupt headers (kiln.core.model.safetensors_header), truncated files and shapes
that do not match config.json. `load_rank_weights` makes the same checks on
the files it reads, then reads one rank's slices without materialising the
whole model. An image-text checkpoint's text decoder is read under its own names
(kiln.core.model.hf_config.multimodal); its vision tower is never read. `write_checkpoint` writes the same layout,
sharded with an index file when asked.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file

from kiln.core.model.config import BUNDLED_MODEL, TINY, ModelConfig
from kiln.core.errors import BadInput
from kiln.core.model.hf_config import from_hf, to_hf
from kiln.core.model.hf_config.multimodal import text_tensors, wrapper_of
from kiln.core.model import quant
from kiln.core.model.safetensors_header import DTYPES, TensorEntry, index_weight_map
from kiln.host.model import expected_shapes, random_state_dict, rank_constants
from kiln.host.weights.safetensors_io import SafetensorsFile

INDEX = "model.safetensors.index.json"


def _headers(path: Path) -> dict[str, tuple[Path, TensorEntry]]:
    """tensor name -> (its file, its header entry): the files the index names (kiln.core.model.safetensors_header
    checks the index), else every *.safetensors; each file's header read and checked. BadInput naming the
    file and the field when any of it is wrong, or when the index places a tensor in a file that lacks it."""
    index = path / INDEX
    if index.exists():
        placed = {name: path / file for name, file in index_weight_map(index.read_bytes(), str(index)).items()}
        files = sorted(set(placed.values()))
    else:
        placed = None
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise BadInput(f"{path} has no *.safetensors files; a checkpoint needs config.json and its weights.")
    out: dict[str, tuple[Path, TensorEntry]] = {}
    for file in files:
        with SafetensorsFile(file) as f:
            out.update({name: (file, entry) for name, entry in f.tensors.items()
                        if placed is None or placed.get(name) == file})
    if placed is not None:
        for name, file in placed.items():
            if name not in out:
                raise BadInput(f"{index}: weight_map places tensor {name!r} in {file.name}, whose header does not "
                               "hold it; fix the index or re-download the checkpoint.")
    return out


def _raw_config(path: Path) -> dict:
    """The checkpoint's config.json, parsed; BadInput when the directory, the file or its JSON is not there."""
    if not path.is_dir():
        raise BadInput(f"checkpoint directory {path} does not exist; pass --model tiny or a directory "
                       "with config.json and *.safetensors (kiln checkpoint DIR writes one).")
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise BadInput(f"{path} has no config.json; a Hugging Face-layout checkpoint needs one.")
    try:
        return json.loads(cfg_file.read_text())
    except ValueError as exc:
        raise BadInput(f"{cfg_file} is not valid JSON ({exc}).") from None


def read_config(path: Path | str) -> ModelConfig:
    return from_hf(_raw_config(Path(path)))


MTP_FAMILIES = ("deepseek_v3", "deepseek_v32", "glm_moe_dsa")
"""Families whose published checkpoints hold a multi-token-prediction module after the decoder layers."""


def _spare(name: str, cfg: ModelConfig) -> bool:
    """Tensors a checkpoint may hold that the model does not read: a tied head's copy, cached rotary tables,
    DeepSeek-V3's (V3.2's, GLM-5's) multi-token-prediction module (the layers after num_hidden_layers:
    published checkpoints hold it for speculative decoding, and one step does not use it)."""
    if name == "lm_head.weight" and cfg.tie_word_embeddings or name.endswith("rotary_emb.inv_freq"):
        return True
    layer = name.removeprefix("model.layers.").split(".", 1)[0]
    return cfg.architecture in MTP_FAMILIES and name.startswith("model.layers.") and layer.isdigit() \
        and int(layer) >= cfg.num_layers


def missing_hint(missing: list[str], present) -> str:
    """What a checkpoint lacking `missing` (and holding `present`) most likely is, for the refusal's words."""
    if all(quant.is_scale(n) for n in missing):
        return (" (config.json's quantization_config says the decoder's projections are FP8 blocks, each beside its "
                "weight_scale_inv; these are not: drop quantization_config, or export the FP8 checkpoint itself)")
    if missing == ["lm_head.weight"]:
        return (" (config.json says tie_word_embeddings: false; a checkpoint without lm_head.weight ties it "
                "to the embeddings)")
    if any(n.endswith(("_blocks", "_scales")) for n in present):
        return (" (it holds MXFP4 experts, `_blocks` beside `_scales`, as gpt-oss is published, but config.json "
                "has no quantization_config with quant_method mxfp4: restore the checkpoint's config.json)")
    fused = sorted(n for n in present if n.endswith((".experts.gate_up_proj", ".experts.down_proj")))
    if fused:
        return (f" (it holds experts fused as 3-D tensors, e.g. {fused[0]}: transformers 5's in-memory layout; "
                "Kiln reads experts one tensor per expert, as published checkpoints and transformers' "
                "save_pretrained write them: re-save the model with save_pretrained)")
    return ""


def check_tensors(where: str, cfg: ModelConfig, have: dict[str, tuple[str, tuple[int, ...], str]]) -> None:
    """BadInput unless the checkpoint at `where` holds every tensor config.json implies with its shape, and no
    tensor the model does not read (a bias the config does not declare would otherwise be dropped silently),
    each FP8 exactly where config.json says (check_quantized).
    `have`: tensor name -> (its file as the message names it, its shape, its safetensors dtype code)."""
    want = expected_shapes(cfg)
    missing = sorted(set(want) - set(have))
    if cfg.quant is None and any(quant.is_scale(n) for n in have):
        raise BadInput(f"{where} holds FP8 block scales (e.g. {next(n for n in sorted(have) if quant.is_scale(n))}) "
                       "but config.json has no quantization_config; restore the checkpoint's config.json.")
    if missing:
        raise BadInput(f"{where} lacks {len(missing)} tensor(s) that config.json implies, e.g. {missing[0]}"
                       f"{missing_hint(missing, have)}; the checkpoint does not match its config.")
    unused = sorted(n for n in set(have) - set(want) if not _spare(n, cfg))
    if unused:
        raise BadInput(f"{where} holds {len(unused)} tensor(s) that config.json does not account for, e.g. "
                       f"{unused[0]}; Kiln would ignore them and compute something else. Fix config.json "
                       "(e.g. attention_bias / mlp_bias) or remove them.")
    for name, shape in want.items():
        file, got = have[name][:2]
        if tuple(got) != shape:
            raise BadInput(f"{file}: tensor {name} has shape {list(got)} but config.json implies "
                           f"{list(shape)}; the checkpoint does not match its config.")
    check_quantized(cfg, {name: (have[name][0], have[name][2]) for name in want})


def check_quantized(cfg: ModelConfig, have: dict[str, tuple[str, str]]) -> None:
    """BadInput unless each tensor's dtype (`have`: name -> (its file, its safetensors code)) is FP8 exactly
    where config.json's quantization says (kiln.core.model.quant: a projection F8_E4M3, its scales F32), naming
    the first that is not."""
    fp8 = quant.WEIGHT_DTYPE
    for name, (file, code) in have.items():
        got = DTYPES[code].torch_name
        if quant.is_quantized(cfg.quant, name) and got != quant.weight_dtype(cfg.quant, name):
            scales = "UE8M0 .scale" if cfg.quant.scale_fmt == "ue8m0" else "a float32 weight_scale_inv"
            what = ("FP4 (I8, two e2m1 codes a byte, beside UE8M0 .scale)" if quant.is_fp4(cfg.quant, name) else
                    f"FP8 blocks (F8_E4M3 beside {scales})")
            raise BadInput(f"{file}: tensor {name} is {code}, but config.json's quantization_config says the "
                           f"decoder's projections are {what}; Kiln reads every projection quantized (its "
                           "modules_to_not_convert may list only embeddings, routers and the output head).")
        if quant.is_scale(name) and got != quant.scale_dtype(cfg.quant):
            raise BadInput(f"{file}: tensor {name} is {code}; Kiln reads "
                           + ("UE8M0 (F8_E8M0)" if cfg.quant.scale_fmt == "ue8m0" else "float32 (F32)")
                           + " block scales, as config.json's quantization_config says.")
        if name.endswith(("_blocks", "_scales")) and got != "uint8":  # gpt-oss's MXFP4
            raise BadInput(f"{file}: tensor {name} is {code}; MXFP4 blocks and scales are bytes (U8), as "
                           "gpt-oss publishes them.")
        if got == fp8 and not quant.is_quantized(cfg.quant, name):
            raise BadInput(f"{file}: tensor {name} is FP8 ({code}), but "
                           + ("config.json has no quantization_config" if cfg.quant is None else
                              "Kiln reads only a decoder layer's projections quantized")
                           + "; the checkpoint does not match its config.")


def _decoder_tensors(path: Path) -> tuple[dict[str, tuple[Path, TensorEntry]], dict[str, str], dict | None]:
    """The checkpoint's tensors (`_headers`) as its text decoder names them, the names they have in the files,
    and for an image-text checkpoint what its export leaves out and its prefixes
    (kiln.core.model.hf_config.multimodal.text_tensors)."""
    return text_tensors(_raw_config(path), _headers(path), lambda t: t[1].end_byte - t[1].begin_byte)


def _checked(path: Path, cfg: ModelConfig) -> tuple[dict[str, tuple[Path, TensorEntry]], dict[str, str]]:
    """The decoder's tensors and their names in the files (`_decoder_tensors`) after `check_tensors`."""
    have, stored, _ = _decoder_tensors(path)
    check_tensors(str(path), cfg, {name: (str(file), entry.shape, entry.dtype)
                                   for name, (file, entry) in have.items()})
    return have, stored


def image_text(path: Path | str) -> dict | None:
    """For an image-text checkpoint, {'left_out': what its export leaves out, in the report's words;
    'prefixes': where its text decoder's tensors are} (kiln.core.model.hf_config.multimodal.text_tensors);
    None for a text-only checkpoint."""
    path = Path(path)
    return None if wrapper_of(_raw_config(path)) is None else _decoder_tensors(path)[2]


def inspect_checkpoint(path: Path | str) -> ModelConfig:
    """Check config, index, headers and shapes without loading weights (BadInput naming the file and the
    field); return the config."""
    path = Path(path)
    cfg = read_config(path)
    _checked(path, cfg)
    return cfg


def load_rank_weights(path: Path | str, cfg: ModelConfig, tp: int, rank: int) -> dict[str, torch.Tensor]:
    """One rank's package constants (kiln.core.model.contract), in `cfg.dtype` (the dtype compiled for). The
    files this process reads get inspect_checkpoint's checks first (a host's copy is not the one the flow
    inspected). Each constant is allocated once and its slices read straight from the files into it
    (kiln.host.weights.safetensors_io): the rank's weights are never held twice, and the checkpoint is not
    memory-mapped into this process."""
    have, stored = _checked(Path(path), cfg)
    files: dict[Path, SafetensorsFile] = {}

    def read_into(name: str, cut: tuple | None, out: torch.Tensor) -> None:
        file = have[name][0]
        if file not in files:
            files[file] = SafetensorsFile(file)
        files[file].read_into(stored.get(name, name), cut, out)

    try:
        return rank_constants(cfg, tp, rank, read_into, getattr(torch, cfg.dtype))
    finally:
        for f in files.values():
            f.close()


def write_checkpoint(path: Path | str, cfg: ModelConfig, state: dict[str, torch.Tensor],
                     num_shards: int = 1) -> Path:
    """Write config.json and the weights; with num_shards > 1, several files and an index."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    names = sorted(state)
    if num_shards <= 1:
        save_file({n: state[n].contiguous() for n in names}, str(path / "model.safetensors"))
    else:
        weight_map = {}
        for i in range(num_shards):
            file = f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors"
            part = names[i::num_shards]
            save_file({n: state[n].contiguous() for n in part}, str(path / file))
            weight_map.update({n: file for n in part})
        (path / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}, indent=2))
    (path / "config.json").write_text(json.dumps(to_hf(cfg), indent=2))
    return path


def checkpoint_files(path: Path | str, digests: Path | None = None) -> list[dict]:
    """[{'name', 'size_bytes', 'sha256'}] of the files that make a checkpoint's content, sorted by name: its
    config.json, index and *.safetensors files (headers and weights alike).

    `digests` (a directory in the host's cache) remembers each file's digest by
    its inode, size, mtime and ctime (kiln.host.machine.cache.file_digest), so a second
    call reads no weights; None reads every file every time.
    """
    from kiln.host.machine.cache import file_digest
    path = Path(path)
    files = sorted(f for f in path.iterdir()
                   if f.is_file() and (f.suffix == ".safetensors" or f.name in ("config.json", INDEX)))
    return [{"name": f.name, "size_bytes": f.stat().st_size, "sha256": file_digest(f, digests)} for f in files]


def files_fingerprint(files: list[dict]) -> str:
    """The identity of a checkpoint's content (16 hex characters) from its `checkpoint_files`."""
    import hashlib

    items = [(f["name"], f["sha256"]) for f in files]
    return hashlib.sha256(json.dumps(items).encode()).hexdigest()[:16]


def checkpoint_fingerprint(path: Path | str, digests: Path | None = None) -> str:
    """The identity of a checkpoint's content: sha256 over the names and content digests of its files
    (checkpoint_files; `digests` as there)."""
    return files_fingerprint(checkpoint_files(path, digests))


def random_checkpoint(path: Path | str, cfg: ModelConfig, *, seed: int = 0, num_shards: int = 1) -> Path:
    return write_checkpoint(path, cfg, random_state_dict(cfg, seed), num_shards)


def tiny_checkpoint(home: Path | str) -> Path:
    """The bundled tiny model, written once under `home`/models/tiny (seeded, so always the same)."""
    path = Path(home) / "models" / BUNDLED_MODEL
    if (path / "config.json").exists():
        return path
    tmp = path.with_name(f"tiny.tmp-{os.getpid()}")
    random_checkpoint(tmp, TINY, seed=0, num_shards=2)
    try:
        tmp.rename(path)
    except OSError:  # another process wrote it first
        pass
    return path
