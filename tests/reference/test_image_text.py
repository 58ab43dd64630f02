"""The text decoder of an image-text checkpoint (kiln.core.model.hf_config.multimodal), read from either layout and
from S3 as from a directory. That it computes what transformers' ForConditionalGeneration class computes on text
is test_eager_reference's (the *-image-text cases) and test_export_run's (the gemma3-image-text export)."""

from __future__ import annotations

import json
import shutil

import boto3
import pytest
import torch
from hf_models import write_case
from safetensors.torch import load_file, save_file

from kiln.core.errors import BadInput
from kiln.host.weights import rank_weights
from kiln.host.weights.checkpoint import inspect_checkpoint, load_rank_weights
from kiln.host.weights.s3_checkpoint import S3Checkpoint

IN_MEMORY = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
             ("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."))
"""save_pretrained's names -> transformers 5's in-memory ones (what a checkpoint saved by other tools holds)."""


def _renamed(src, dst, pairs):
    shutil.copytree(src, dst)
    for file in dst.glob("*.safetensors"):
        tensors = load_file(file)
        for old, new in pairs:
            tensors = {new + k[len(old):] if k.startswith(old) else k: v for k, v in tensors.items()}
        save_file(tensors, str(file), metadata={"format": "pt"})
    return dst


def _same(a: dict, b: dict) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.mark.parametrize("case", ["mistral3-image-text", "gemma3-image-text"])
def test_either_layout_reads_the_same_decoder_and_says_what_it_left_out(case, hf_root, tmp_path):
    saved = write_case(case, hf_root)
    in_memory = _renamed(saved, tmp_path / "in-memory", IN_MEMORY)
    cfg = inspect_checkpoint(saved)
    assert inspect_checkpoint(in_memory) == cfg
    for rank in range(2):
        _same(load_rank_weights(saved, cfg, 2, rank), load_rank_weights(in_memory, cfg, 2, rank))
    names = list(load_file(next(saved.glob("*.safetensors"))))
    vision = [n for n in names if not n.startswith("language_model.")]
    said = rank_weights.image_text(str(saved))
    assert f"left out {len(vision)} tensors" in said["left_out"] and vision
    assert "multi_modal_projector" in said["left_out"] and "vision_tower" in said["left_out"]
    untied = not cfg.tie_word_embeddings  # Mistral 3's head is untied here, Gemma 3's tied
    assert said["prefixes"] == {"model.": "language_model.model.",
                                **({"lm_head.": "language_model.lm_head."} if untied else {})}
    assert rank_weights.image_text(str(in_memory))["prefixes"] == {"model.": "model.language_model.",
                                                                   **({"lm_head.": "lm_head."} if untied else {})}
    assert rank_weights.image_text(str(write_case("mistral-window", hf_root))) is None  # a text-only checkpoint


def test_a_checkpoint_with_its_decoder_under_two_layouts_is_refused(hf_root, tmp_path):
    saved = write_case("mistral3-image-text", hf_root)
    both = _renamed(saved, tmp_path / "both", [("language_model.model.layers.1.", "model.language_model.layers.1.")])
    with pytest.raises(BadInput, match=r"several prefixes \(language_model.model., model.language_model.\)"):
        inspect_checkpoint(both)


def test_an_image_text_checkpoint_in_s3_reads_as_the_directory(hf_root, s3_bucket, s3_server):
    folder = write_case("mistral3-image-text", hf_root)
    bucket = s3_bucket[5:].split("/")[0]
    client = boto3.client("s3", endpoint_url=s3_server.endpoint_url)
    for f in sorted(folder.iterdir()):
        client.upload_file(str(f), bucket, f"image-text/{f.name}")
    ck = S3Checkpoint(f"s3://{bucket}/image-text", endpoint_url=s3_server.endpoint_url)
    cfg = ck.inspect()
    assert cfg == inspect_checkpoint(folder) and cfg.architecture == "mistral"
    _same(ck.load_rank_weights(cfg, 2, 1), load_rank_weights(folder, cfg, 2, 1))
    assert ck.image_text() == rank_weights.image_text(str(folder))


def test_an_image_text_checkpoint_whose_decoder_kiln_does_not_compute_is_refused_by_name(hf_root, tmp_path):
    path = shutil.copytree(write_case("gemma3-image-text", hf_root), tmp_path / "qwen3_5")
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "model_type": "qwen3_5"}))
    with pytest.raises(BadInput, match="text decoder is qwen3_5_text, which Kiln does not export yet"):
        inspect_checkpoint(path)
