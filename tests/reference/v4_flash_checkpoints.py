"""DeepSeek-V4 checkpoints in the layout DeepSeek-V4-Flash is published in, made here from a random-init
transformers model (nothing downloaded).

The layout (transformers 5.25 reads it with `FineGrainedFP8Config(dequantize=True)`):
- FP8 projections: `X.weight` float8_e4m3fn [out, in] beside `X.scale` float8_e8m0fnu (UE8M0: a power of two)
  [ceil(out / 128), ceil(in / 128)], the weight being weight x scale block by block. Which: every nn.Linear
  transformers' FP8 quantizer converts, i.e. attention's wq_a, wq_b, wkv, wo_a, wo_b, the indexer's wq_b and
  the shared expert's w1, w2, w3; not the compressors' and the indexer's other projections
  (DeepseekV4PreTrainedModel._keep_in_fp32_modules), the router, the embedding or the head;
- FP4 experts (config.json's `expert_dtype` "fp4"): each `ffn.experts.E.wN.weight` int8 [out, in / 2], two
  e2m1 codes a byte, the even column in the low nibble, beside `.scale` float8_e8m0fnu [out, in / 32];
- config.json's quantization_config {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
  "weight_block_size": [128, 128], "scale_fmt": "ue8m0"} and top-level "expert_dtype": "fp4".

`dequantized` is an independent dequantization of the same bytes (no Kiln, no transformers), to hold the
reference to.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

BLOCK = 128
FP8_MAX = 448.0
FP4_GROUP = 32
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                       "weight_block_size": [BLOCK, BLOCK], "scale_fmt": "ue8m0"}
FP8 = re.compile(r"\.(attn\.(wq_a|wq_b|wkv|wo_a|wo_b)|attn\.indexer\.wq_b|ffn\.shared_experts\.w[123])\.weight$")
FP4 = re.compile(r"\.ffn\.experts\.\d+\.w[123]\.weight$")


def _power_of_two(amax, top: float):
    """The smallest power of two s with amax / s <= top (UE8M0 scales), at least 2^-126."""
    import torch

    return torch.exp2(torch.ceil(torch.log2((amax / top).clamp(min=2.0 ** -126))))


def quantize_fp8(weight):
    """(float8_e4m3fn weight, float8_e8m0fnu scale per 128 x 128 block, the edge blocks partial)."""
    import torch

    rows, cols = weight.shape
    r, c = -(-rows // BLOCK), -(-cols // BLOCK)
    padded = torch.zeros(r * BLOCK, c * BLOCK)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(r, BLOCK, c, BLOCK)
    scales = _power_of_two(blocks.abs().amax(dim=(1, 3)), FP8_MAX)
    q = (blocks / scales[:, None, :, None]).to(torch.float8_e4m3fn).reshape(padded.shape)[:rows, :cols]
    return q.contiguous(), scales.to(torch.float8_e8m0fnu)


def quantize_fp4(weight):
    """(int8 [rows, cols / 2]: two e2m1 codes a byte, the even column low; float8_e8m0fnu [rows, cols / 32])."""
    import torch

    rows, cols = weight.shape
    groups = weight.float().view(rows, cols // FP4_GROUP, FP4_GROUP)
    scales = _power_of_two(groups.abs().amax(dim=-1), E2M1[-1])
    x = (groups / scales[..., None]).reshape(rows, cols)
    values = torch.tensor(E2M1)
    code = (x.abs()[..., None] - values).abs().argmin(dim=-1)  # the nearest magnitude
    code = code | ((x < 0) & (code > 0)).to(torch.int64) << 3
    packed = (code[:, 0::2] | code[:, 1::2] << 4).to(torch.uint8).view(torch.int8)
    return packed.contiguous(), scales.to(torch.float8_e8m0fnu)


def dequantize_fp8(q, scales):
    import torch

    rows, cols = q.shape
    s = scales.float().repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:rows, :cols]
    return q.float() * s


def dequantize_fp4(packed, scales):
    import torch

    lut = torch.tensor([*E2M1, *(-v for v in E2M1)])
    u8 = packed.view(torch.uint8).to(torch.int64)
    values = torch.stack([lut[u8 & 15], lut[u8 >> 4]], dim=-1).reshape(packed.shape[0], -1)
    return values * scales.float().repeat_interleave(FP4_GROUP, 1)


def write_v4_flash(model, root: Path, dequantized_too: bool = True) -> tuple[Path, dict]:
    """(the V4-Flash-layout checkpoint of `model` at root / 'flash', name -> the float32 weight its bytes
    dequantize to for every quantized tensor, or {} without `dequantized_too`)."""
    import torch
    from safetensors.torch import load_file, save_file

    model.to(torch.bfloat16).save_pretrained(root / "bf16")
    config = {**json.loads((root / "bf16" / "config.json").read_text()),
              "quantization_config": QUANTIZATION_CONFIG, "expert_dtype": "fp4"}
    published, dequantized = {}, {}
    for name, tensor in load_file(root / "bf16" / "model.safetensors").items():
        quantize, dequantize = ((quantize_fp8, dequantize_fp8) if FP8.search(name)
                                else (quantize_fp4, dequantize_fp4) if FP4.search(name) else (None, None))
        if quantize is None:
            published[name] = tensor
            continue
        q, scales = quantize(tensor)
        published[name], published[name.removesuffix(".weight") + ".scale"] = q, scales
        if dequantized_too:
            dequantized[name] = dequantize(q, scales)
    out = root / "flash"
    out.mkdir(parents=True, exist_ok=True)
    save_file(published, out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out, dequantized
