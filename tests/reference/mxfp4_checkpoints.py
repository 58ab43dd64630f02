"""gpt-oss checkpoints in MXFP4 as gpt-oss is published, made here from a random-init transformers model (nothing
downloaded); transformers' own dequantization (`Mxfp4Config(dequantize=True)`) is the reference.

The published layout: each layer's experts as `mlp.experts.gate_up_proj_blocks` uint8 [experts, 2 x
intermediate, hidden / 32, 16] (32 e2m1 codes per 16 bytes, the even input in the low nibble) beside
`..._scales` uint8 [experts, 2 x intermediate, hidden / 32] (a power of two per 32 inputs, exponent + 127), the
same for `down_proj` over [experts, hidden, intermediate / 32, 16]; the experts' biases, attention, router,
embeddings and head bfloat16; config.json's quantization_config {"quant_method": "mxfp4", ...}. The quantizer
here is written from that description (the power of two at least amax / 6 per group, each value rounded to
the nearest e2m1 magnitude), independent of Kiln's.
"""

from __future__ import annotations

import json
from pathlib import Path

E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
QUANTIZATION_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def quantize(weight):
    """(blocks uint8 [..., rows, cols / 32, 16], scales uint8 [..., rows, cols / 32]) of `weight` [..., rows, cols]."""
    import torch

    *lead, cols = weight.shape
    groups = weight.float().reshape(*lead, cols // 32, 32)
    exponent = torch.ceil(torch.log2((groups.abs().amax(dim=-1) / 6.0).clamp(min=2.0 ** -126)))
    x = groups / torch.exp2(exponent)[..., None]
    code = (x.abs()[..., None] - torch.tensor(E2M1)).abs().argmin(dim=-1)
    code = code | ((x < 0) & (code > 0)).long() << 3
    blocks = (code[..., 0::2] | code[..., 1::2] << 4).to(torch.uint8)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8)


def write_mxfp4(model, root: Path) -> Path:
    """The published MXFP4 checkpoint of gpt-oss `model` under root/mxfp4 (its bfloat16 save under root/bf16)."""
    import torch
    from safetensors.torch import load_file, save_file

    model.to(torch.bfloat16).save_pretrained(root / "bf16")
    config = {**json.loads((root / "bf16" / "config.json").read_text()), "quantization_config": QUANTIZATION_CONFIG}
    published = {}
    for name, tensor in load_file(root / "bf16" / "model.safetensors").items():
        if name.endswith((".experts.gate_up_proj", ".experts.down_proj")):  # [E, in, out] -> output-major groups
            published[f"{name}_blocks"], published[f"{name}_scales"] = quantize(tensor.transpose(1, 2))
        else:
            published[name] = tensor
    (root / "mxfp4").mkdir(parents=True, exist_ok=True)
    save_file(published, root / "mxfp4" / "model.safetensors", metadata={"format": "pt"})
    (root / "mxfp4" / "config.json").write_text(json.dumps(config, indent=2))
    return root / "mxfp4"


def dequantized_reference(path: Path, dtype: str = "float32"):
    """transformers' GptOssForCausalLM of the MXFP4 checkpoint at `path`, dequantized by transformers itself."""
    import torch
    import transformers

    return transformers.GptOssForCausalLM.from_pretrained(
        path, dtype=getattr(torch, dtype), quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
