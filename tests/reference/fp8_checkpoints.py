"""FP8-block checkpoints as DeepSeek-V3 and Qwen3's FP8 ones are published, made here from a random-init
transformers model (nothing downloaded), and the directory transformers' own dequantization reads.

The published layout: every projection of every decoder layer `X.weight` float8_e4m3fn [out, in] beside
`X.weight_scale_inv` float32 [ceil(out / 128), ceil(in / 128)] (the weight is weight x scale_inv per block, the
edge blocks partial); embeddings, norms, routers and lm_head bfloat16; config.json's quantization_config.

transformers (5.25, `FineGrainedFP8Config(dequantize=True)`) takes each tensor's block from its scale grid
(rows // scale rows), so a tensor of several blocks whose last one is partial raises (320 rows over 3 scale
rows) or is read with wrong blocks where the rows happen to divide (192 over 2: 96-row blocks). The reference
directory therefore holds such tensors dequantized by DeepSeek's convention (128-row blocks, the last partial:
`dequantize` here, independent of Kiln) and every other projection as published, which transformers
dequantizes itself.
"""

from __future__ import annotations

import json
from pathlib import Path

BLOCK = 128
FP8_MAX = 448.0
QUANTIZED = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "q_a_proj", "q_b_proj",
             "kv_a_proj_with_mqa", "kv_b_proj")
QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                       "weight_block_size": [BLOCK, BLOCK]}


def quantize(weight):
    """(float8_e4m3fn weight, float32 scale_inv per 128 x 128 block): each block scaled by its amax / 448."""
    import torch

    rows, cols = weight.shape
    scales = torch.zeros(-(-rows // BLOCK), -(-cols // BLOCK))
    q = torch.zeros(rows, cols, dtype=torch.float8_e4m3fn)
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            block = weight[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK].float()
            scales[i, j] = block.abs().max() / FP8_MAX
            q[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] = (block / scales[i, j]).to(torch.float8_e4m3fn)
    return q, scales


def dequantize(q, scales):
    """float32 weight x scale, block by block (DeepSeek's convention: 128-row and -column blocks, the last partial)."""
    out = q.float().clone()
    for i in range(scales.shape[0]):
        for j in range(scales.shape[1]):
            out[i * BLOCK:(i + 1) * BLOCK, j * BLOCK:(j + 1) * BLOCK] *= scales[i, j]
    return out


def misread(shape) -> bool:
    """transformers misreads (or refuses) the blocks of a tensor of `shape`: several blocks, the last partial."""
    return any(n > BLOCK and n % BLOCK for n in shape)


def write_fp8(model, root: Path) -> tuple[Path, Path]:
    """(the published FP8 checkpoint of `model`, the directory transformers' dequantization reads), under root."""
    import torch
    from safetensors.torch import load_file, save_file

    model.to(torch.bfloat16).save_pretrained(root / "bf16")
    config = {**json.loads((root / "bf16" / "config.json").read_text()), "quantization_config": QUANTIZATION_CONFIG}
    published, reference = {}, {}
    for name, tensor in load_file(root / "bf16" / "model.safetensors").items():
        if name.endswith(".weight") and name.rsplit(".", 2)[-2] in QUANTIZED:
            q, scales = quantize(tensor)
            published[name], published[name + "_scale_inv"] = q, scales
            if misread(tensor.shape):
                reference[name] = dequantize(q, scales)
            else:
                reference[name], reference[name + "_scale_inv"] = q, scales
        else:
            published[name] = reference[name] = tensor
    out = []
    for kind, tensors in (("fp8", published), ("reference", reference)):
        (root / kind).mkdir(parents=True, exist_ok=True)
        save_file(tensors, root / kind / "model.safetensors", metadata={"format": "pt"})
        (root / kind / "config.json").write_text(json.dumps(config, indent=2))
        out.append(root / kind)
    return out[0], out[1]
