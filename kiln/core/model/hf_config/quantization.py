"""config.json's `quantization_config`: the quantized format Kiln reads (FP8 blocks), and every other refused by name.

Pure: no torch import. Read as transformers' FineGrainedFP8Config reads it, field by field:
- `quant_method` "fp8" with a `weight_block_size` [rows, cols]: FP8 blocks (kiln.core.model.quant); "mxfp4" in a
  gpt-oss checkpoint: its experts' MXFP4 blocks and scales (modules_to_not_convert may list anything but the
  experts, as gpt-oss's own lists attention, router, embeddings and head); any other method (gptq, awq,
  bitsandbytes, compressed-tensors, ...) or FP8 without blocks is refused, naming it and saying what Kiln reads;
- `fmt` "e4m3" (or absent): the weights are float8_e4m3fn; `activation_scheme` "dynamic" (or absent):
  activations are not quantized with static scales from the checkpoint (Kiln computes them in the compute
  dtype, as transformers' dequantized model does);
- `scale_fmt` "float" (or absent) and `expert_dtype` "fp8" (or absent): float32 scales, FP8 experts; in a
  DeepSeek-V4 checkpoint also "ue8m0" and "fp4" (V4-Flash's UE8M0 `.scale` and FP4 experts;
  `expert_dtype` may also be config.json's top-level field, as V4-Flash writes it);
- `modules_to_not_convert` (or MiniMax's `ignored_layers`): a list of module names, checked by the
  checkpoint itself: every projection Kiln reads as quantized must be F8_E4M3 with its scales in the headers
  (kiln.host.weights.checkpoint.check_tensors), so a list that keeps one of them unquantized is refused there,
  naming the tensor; `dequantize` is a loading option of transformers' and changes nothing here.
"""

from __future__ import annotations

from kiln.core.errors import BadInput
from kiln.core.model.quant import FP4_GROUP, FP8_BLOCKS, MXFP4, WeightQuant

FIELD = "quantization_config"

_READS = ("Kiln reads FP8 block-quantized weights (quant_method fp8, fmt e4m3, activation_scheme dynamic, a "
          "weight_block_size, float32 weight_scale_inv per block), as DeepSeek-V3 and Qwen3's FP8 checkpoints "
          "are published; DeepSeek-V4's with UE8M0 scales (scale_fmt ue8m0) and FP4 experts (expert_dtype fp4), "
          "as DeepSeek-V4-Flash is published; gpt-oss's MXFP4 experts (quant_method mxfp4); and unquantized "
          "float32/bfloat16/float16 ones")

_INERT = frozenset({"quant_method", "fmt", "activation_scheme", "weight_block_size", "modules_to_not_convert",
                    "ignored_layers", "scale_fmt", "expert_dtype", "dequantize", "modules_to_convert"})
"""The fields of an FP8-block quantization_config; any other is refused."""


def read_quantization(raw: dict, family: str) -> WeightQuant | None:
    """The WeightQuant of a config.json's quantization_config (None when there is none); BadInput naming the
    field and its value for anything Kiln does not read."""
    quant = raw.get(FIELD)
    if quant is None:
        if raw.get("expert_dtype") not in (None, "fp8"):
            raise BadInput(f"config.json: expert_dtype={raw['expert_dtype']!r} without a {FIELD}: {_READS}.")
        return None
    if isinstance(quant, dict) and raw.get("expert_dtype") is not None:  # V4-Flash: top level (transformers moves it)
        if quant.get("expert_dtype", raw["expert_dtype"]) != raw["expert_dtype"]:
            raise BadInput(f"config.json: expert_dtype={raw['expert_dtype']!r} but {FIELD} expert_dtype="
                           f"{quant['expert_dtype']!r}; one checkpoint has one format.")
        quant = {**quant, "expert_dtype": raw["expert_dtype"]}
    if not isinstance(quant, dict):
        raise BadInput(f"config.json: {FIELD}={quant!r} must be an object.")
    method = quant.get("quant_method")
    if method == "mxfp4":
        return _mxfp4(quant, family)
    if method != "fp8" or quant.get("weight_block_size") is None:
        what = f"quant_method={method!r}" if method != "fp8" else "quant_method 'fp8' without a weight_block_size"
        raise BadInput(f"config.json: {FIELD} {what}: {_READS}. Export an unquantized checkpoint of this model "
                       "instead.")
    if family in ("deepseek_v32", "glm_moe_dsa"):
        raise BadInput(f"config.json: {FIELD}={quant!r}: Kiln does not read FP8 blocks of {family}'s lightning indexer "
                       "(which of its projections are FP8 is not yet held to a published checkpoint); export a "
                       "bfloat16 checkpoint of it.")
    if family in ("phi3", "mistral4", "llama4_text"):
        fused = "qkv_proj and gate_up_proj" if family == "phi3" else "3-D experts (gate_up_proj, down_proj)"
        raise BadInput(f"config.json: {FIELD}={quant!r}: Kiln does not read FP8 blocks over {family}'s fused "
                       f"{fused}; export a bfloat16 checkpoint of it.")
    unknown = sorted(set(quant) - _INERT)
    v4 = family == "deepseek_v4"
    for name, want in (("fmt", ("e4m3",)), ("activation_scheme", ("dynamic",)),
                       ("scale_fmt", ("float", "ue8m0") if v4 else ("float",)),
                       ("expert_dtype", ("fp8", "fp4") if v4 else ("fp8",))):
        if quant.get(name, want[0]) not in want:
            unknown.append(name)
    if unknown:
        raise BadInput(f"config.json: {FIELD} " + ", ".join(f"{k}={quant[k]!r}" for k in unknown)
                       + f": {_READS}.")
    for name in ("modules_to_not_convert", "ignored_layers", "modules_to_convert"):
        names = quant.get(name)
        if names is not None and (not isinstance(names, list) or not all(isinstance(n, str) for n in names)):
            raise BadInput(f"config.json: {FIELD} {name}={names!r} must be a list of module names.")
    if quant.get("modules_to_convert"):
        raise BadInput(f"config.json: {FIELD} modules_to_convert={quant['modules_to_convert']!r}: quantized "
                       f"embeddings are not read; {_READS}.")
    block = quant["weight_block_size"]
    if not isinstance(block, list) or len(block) != 2 or not all(
            isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block):
        raise BadInput(f"config.json: {FIELD} weight_block_size={block!r} must be two positive integers "
                       "[rows, cols].")
    return WeightQuant(FP8_BLOCKS, tuple(block), quant.get("scale_fmt", "float"), quant.get("expert_dtype", "fp8"))


_MXFP4_READS = frozenset({"quant_method", "modules_to_not_convert", "dequantize"})
MXFP4_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]
"""gpt-oss's published modules_to_not_convert: everything but the experts."""


def _mxfp4(quant: dict, family: str) -> WeightQuant:
    """gpt-oss's MXFP4: its experts' blocks and scales (kiln.core.model.gpt_oss_fields), nothing else quantized;
    modules_to_not_convert may list anything but the experts."""
    if family != "gpt_oss":
        raise BadInput(f"config.json: {FIELD} quant_method='mxfp4' is gpt-oss's format (its experts' _blocks and "
                       f"_scales); a {family} checkpoint in it is not read: {_READS}.")
    unknown = sorted(set(quant) - _MXFP4_READS)
    if unknown:
        raise BadInput(f"config.json: {FIELD} " + ", ".join(f"{k}={quant[k]!r}" for k in unknown)
                       + f": Kiln reads mxfp4's quant_method and modules_to_not_convert.")
    names = quant.get("modules_to_not_convert") or []
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise BadInput(f"config.json: {FIELD} modules_to_not_convert={names!r} must be a list of module names.")
    experts = [n for n in names if "experts" in n or n.rstrip(".*") in ("model", "model.layers", "model.layers.*",
                                                                        "model.layers.*.mlp")]
    if experts:
        raise BadInput(f"config.json: {FIELD} modules_to_not_convert lists {experts[0]!r}: in an mxfp4 checkpoint "
                       "the experts are what is quantized; drop quantization_config if they are not.")
    return WeightQuant(MXFP4, (1, FP4_GROUP))


def quantization_to_hf(quant: WeightQuant) -> dict:
    """The quantization_config of `quant`, as DeepSeek-V3's (or, UE8M0, V4-Flash's; or gpt-oss's) config.json
    writes it."""
    if quant.method == MXFP4:
        return {"quant_method": "mxfp4", "modules_to_not_convert": list(MXFP4_NOT_CONVERTED)}
    out = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
           "weight_block_size": list(quant.block)}
    if quant.scale_fmt != "float":
        out["scale_fmt"] = quant.scale_fmt
    if quant.experts != "fp8":
        out["expert_dtype"] = quant.experts
    return out
