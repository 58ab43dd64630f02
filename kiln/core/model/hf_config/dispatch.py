"""The table of families, and the two entry points: config.json -> ModelConfig and back.

Pure: no torch import. from_hf reads an image-text checkpoint's text decoder (multimodal.py), finds the
family (model_type, or the one class of `architectures`),
reads `quantization_config` (quantization.py: FP8 blocks, or refused by name), refuses any field that
neither the family reads nor INERT lists, checks that the fields it needs are there, and hands the rest to
the family's module. to_hf refuses a ModelConfig holding a Feature its family's configs cannot hold, then
writes the fields every family has and the family's own.
"""

from __future__ import annotations

from kiln.core.model.config import ARCHITECTURES, ModelConfig
from kiln.core.errors import BadInput
from kiln.core.model.hf_config.deepseek import DEEPSEEK_V3
from kiln.core.model.hf_config.deepseek_v4 import DEEPSEEK_V4
from kiln.core.model.hf_config.dsa import DEEPSEEK_V32, GLM_MOE_DSA
from kiln.core.model.hf_config.common import FEATURES, INERT, Family, shared_hf
from kiln.core.model.hf_config.gemma import GEMMA2, GEMMA3_TEXT
from kiln.core.model.hf_config.gpt_oss import GPT_OSS
from kiln.core.model.hf_config.llama import LLAMA, MISTRAL
from kiln.core.model.hf_config.llama4 import LLAMA4_TEXT
from kiln.core.model.hf_config.minimax import MINIMAX_M2
from kiln.core.model.hf_config.mistral4 import MISTRAL4
from kiln.core.model.hf_config.mixtral import MIXTRAL
from kiln.core.model.hf_config.multimodal import text_decoder
from kiln.core.model.hf_config.phi3 import PHI3
from kiln.core.model.hf_config.quantization import FIELD as QUANTIZATION, quantization_to_hf, read_quantization
from kiln.core.model.hf_config.qwen import QWEN2, QWEN2_MOE, QWEN3, QWEN3_MOE
from kiln.core.model.hf_config.rope import rope_positions, rope_scaling

FAMILIES = {f.name: f for f in (LLAMA, MISTRAL, QWEN2, QWEN3, MIXTRAL, QWEN3_MOE, QWEN2_MOE, GEMMA2, GEMMA3_TEXT,
                                PHI3, DEEPSEEK_V3, DEEPSEEK_V4, GPT_OSS, MINIMAX_M2, MISTRAL4,
                                LLAMA4_TEXT, DEEPSEEK_V32, GLM_MOE_DSA)}
"""model_type -> its Family: every family Kiln reads."""


def from_hf(raw: dict) -> ModelConfig:
    """The ModelConfig of a Hugging Face `config.json` dict; BadInput naming any field Kiln does not compute."""
    if not isinstance(raw, dict):
        raise BadInput("config.json must hold a JSON object.")
    raw = text_decoder(raw)  # an image-text checkpoint: its text decoder's config
    family = _family(raw)
    quant = read_quantization(raw, family.name)
    raw = {k: v for k, v in raw.items() if k != QUANTIZATION}
    unknown = sorted(set(raw) - family.read - set(INERT) - set(family.inert))
    if unknown:
        shown = ", ".join(f"{k}={raw[k]!r}" for k in unknown[:4])
        raise BadInput(f"config.json: {shown}: Kiln does not compute what "
                       f"{'this field changes' if len(unknown) == 1 else 'these fields change'} for a {family.name} "
                       "model, so it cannot export it faithfully (supported fields are listed in the README's "
                       "'Supported models').")
    missing = [k for k in family.required if k not in raw]
    if missing:
        raise BadInput(f"config.json lacks {', '.join(missing)}; it must describe a decoder of a supported family.")
    cfg = family.from_raw(raw)
    return cfg if quant is None else cfg.replace(quant=quant)


def to_hf(cfg: ModelConfig) -> dict:
    """The `config.json` (transformers 4.x spelling) of `cfg`; BadInput for a combination no family has."""
    family = FAMILIES[cfg.architecture]
    for feature in FEATURES:
        if feature not in family.features and feature.held_by(cfg):
            owners = [f.name for f in FAMILIES.values() if feature in f.features]
            raise BadInput(f"{feature.what}: {', '.join(owners)} configs have it; no {family.name} config does.")
    quant = {} if cfg.quant is None else {QUANTIZATION: quantization_to_hf(cfg.quant)}
    return {**shared_hf(cfg, rope_scaling(cfg)), **rope_positions(cfg), **family.to_hf(cfg), **quant}


def _family(raw: dict) -> Family:
    """The family of a config.json: model_type, else the one class of `architectures`; they must agree."""
    model_type = raw.get("model_type")
    archs = raw.get("architectures")
    supported = ", ".join(f"{t} ({ARCHITECTURES[t]})" for t in FAMILIES)
    if model_type is None and isinstance(archs, list) and len(archs) == 1:
        model_type = next((t for t in FAMILIES if ARCHITECTURES[t] == archs[0]), None)
    if model_type is None and archs is None:
        raise BadInput(f"config.json names neither model_type nor architectures; Kiln exports {supported}.")
    if not isinstance(model_type, str) or model_type not in FAMILIES:
        what = f"model_type={model_type!r}" if "model_type" in raw else f"architectures={archs!r}"
        raise BadInput(f"config.json: {what} is not supported; Kiln exports {supported}.")
    if archs is not None and archs != [ARCHITECTURES[model_type]]:
        raise BadInput(f"config.json: architectures={archs!r} is not supported for model_type {model_type!r}; "
                       f"Kiln exports {ARCHITECTURES[model_type]} (a causal LM head over the decoder).")
    return FAMILIES[model_type]
