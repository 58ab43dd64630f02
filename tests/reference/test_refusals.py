"""Checkpoints written by transformers that Kiln does not compute are refused by name, before anything starts.

In this process (`kiln_main`): the refusal comes before Prefect starts; tests/integration/test_bad_input.py
keeps the subprocess case of exit code 2.
"""

from __future__ import annotations

import json

import pytest
from hf_models import hf_config, hf_model

REFUSED = {
    # name: (family, config overrides, the words the message must hold)
    # longrope outside Phi-3: transformers' Llama keeps keys cached under the short factors past the switch.
    "longrope-llama": ("llama", {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 16,
                                                  "long_factor": [4.0] * 16, "original_max_position_embeddings": 64}},
                       "for Phi-3 only"),
    "proportional": ("llama", {"rope_scaling": {"rope_type": "proportional", "factor": 2.0}},
                     "rope_type='proportional'"),
    "gelu": ("llama", {"hidden_act": "gelu"}, "hidden_act='gelu'"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_export_refuses_what_kiln_does_not_compute(name, kiln_main, tmp_path):
    family, overrides, words = REFUSED[name]
    path = tmp_path / name
    hf_model(family, hf_config(family, overrides, "float32")).save_pretrained(path)
    store = tmp_path / "store"
    run = kiln_main("export", "--model", str(path), "--tp", "2", "--store", f"file://{store}")
    assert run.code == 2, run.err[-2000:]
    assert words in run.err and "config.json" in run.err and "Traceback" not in run.err
    assert not store.exists() or not any(store.rglob("*.json")), "nothing may be written for bad input"


def test_an_unknown_family_is_refused(kiln_main, tmp_path):
    path = tmp_path / "gemma"
    hf_model("llama", hf_config("llama", {}, "float32")).save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(model_type="gemma", architectures=["GemmaForCausalLM"])
    (path / "config.json").write_text(json.dumps(cfg))
    run = kiln_main("plan", "--model", str(path), "--tp", "2")
    assert run.code == 2 and "model_type='gemma' is not supported" in run.err, run.err[-2000:]


def test_experts_fused_as_3d_tensors_are_refused_saying_how_to_fix_it(kiln_main, tmp_path):
    """transformers 5 holds experts fused in memory (`mlp.experts.gate_up_proj` [E, 2I, H]); its save_pretrained
    writes them per expert, as published checkpoints are. A checkpoint saved fused is refused, saying so."""
    import torch
    from safetensors.torch import load_file, save_file

    overrides = dict(head_dim=64, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
    path = tmp_path / "fused"
    hf_model("qwen3_moe", hf_config("qwen3_moe", overrides, "float32")).save_pretrained(path)
    flat = load_file(path / "model.safetensors")
    fused = {k: v for k, v in flat.items() if ".experts." not in k}
    for i in range(2):
        p = f"model.layers.{i}.mlp.experts"
        fused[f"{p}.gate_up_proj"] = torch.stack([torch.cat([flat[f"{p}.{e}.gate_proj.weight"],
                                                             flat[f"{p}.{e}.up_proj.weight"]]) for e in range(4)])
        fused[f"{p}.down_proj"] = torch.stack([flat[f"{p}.{e}.down_proj.weight"] for e in range(4)])
    save_file(fused, path / "model.safetensors", metadata={"format": "pt"})
    run = kiln_main("plan", "--model", str(path), "--tp", "2")
    assert run.code == 2, run.err[-2000:]
    assert "experts fused as 3-D tensors" in run.err and "save_pretrained" in run.err, run.err[-2000:]


def test_a_quantization_kiln_does_not_read_is_refused_saying_what_it_reads(kiln_main, tmp_path):
    """Kiln reads FP8 blocks as DeepSeek-V3 is published (kiln.core.model.quant); another format (GPTQ's config
    here) is refused by name, saying what Kiln reads; an FP8-block config over weights that are not FP8 is
    refused naming a block scale the checkpoint lacks."""
    from hf_models import CASES

    family, overrides, _ = CASES["deepseek-v3"]
    path = tmp_path / "fp8"
    hf_model(family, hf_config(family, overrides, "float32")).save_pretrained(path)
    cfg = json.loads((path / "config.json").read_text())
    for quant, words in (({"quant_method": "gptq", "bits": 4}, "quant_method='gptq'"),
                         ({"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                           "weight_block_size": [128, 128]}, "weight_scale_inv")):
        (path / "config.json").write_text(json.dumps({**cfg, "quantization_config": quant}))
        run = kiln_main("plan", "--model", str(path), "--tp", "2")
        assert run.code == 2 and words in run.err and "Traceback" not in run.err, run.err[-2000:]
        assert "quant_method" not in words or "Kiln reads FP8 block-quantized weights" in run.err
