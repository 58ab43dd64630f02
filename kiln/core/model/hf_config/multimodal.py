"""The text decoder of an image-text checkpoint: its config under `text_config`, its weights under a prefix.

Pure: no torch import. Gemma 3, Mistral 3 (Mistral Small 3.1, Magistral), LLaVA, Llama 4 and Kimi K2.5 are published
as image-text checkpoints: a vision tower and a projector beside a text decoder of a family Kiln computes.
Given text alone, their ForConditionalGeneration class computes what the decoder's own CausalLM class does,
so Kiln exports the decoder: `text_config` read by its family (with the text config class's defaults for
the sizes a published text_config leaves out), the output head tied as the outer config says (transformers
ties the composite model's head by the outer tie_word_embeddings), and only the decoder's tensors read.

Contracts: `text_decoder(raw)` is the config.json Kiln's families read, or the same dict for a text-only
checkpoint; every outer field is a vision or token setting that the text decoder does not read, or it is
refused by name. `decoder_names(names)` maps a checkpoint's tensor names to the decoder's (transformers'
save_pretrained layout, `language_model.model.*` and `language_model.lm_head.*`, or transformers 5's in-memory
one, `model.language_model.*` and `lm_head.*`) and lists what is left out (the vision tower, the projector).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from kiln.core.errors import BadInput

T = TypeVar("T")


@dataclass(frozen=True)
class Wrapper:
    """One image-text model_type whose text decoder Kiln exports."""

    name: str
    """Its model_type."""
    classes: tuple[str, ...]
    """Its `architectures` spellings (transformers' class, and the remote-code one where they differ)."""
    text_type: str
    """The text decoder's model_type when text_config names none."""
    tie_word_embeddings: bool
    """The outer config's default for tie_word_embeddings (which ties the composite model's head)."""
    fields: frozenset[str]
    """The outer fields besides text_config: the vision tower's, the projector's and the image tokens' settings,
    none of which the text decoder reads."""


_COMMON = frozenset({"architectures", "model_type", "text_config", "vision_config", "tie_word_embeddings",
                     "transformers_version", "_name_or_path", "dtype", "torch_dtype", "initializer_range",
                     "image_token_index", "image_token_id", "use_cache", "bos_token_id", "eos_token_id",
                     "pad_token_id", "auto_map", "quantization_config"})

WRAPPERS = {w.name: w for w in (
    Wrapper("gemma3", ("Gemma3ForConditionalGeneration",), "gemma3_text", True,
            _COMMON | {"mm_tokens_per_image", "boi_token_index", "eoi_token_index", "boi_token_id", "eoi_token_id"}),
    Wrapper("mistral3", ("Mistral3ForConditionalGeneration",), "mistral", True,
            _COMMON | {"projector_hidden_act", "vision_feature_layer", "multimodal_projector_bias",
                       "spatial_merge_size"}),
    Wrapper("llava", ("LlavaForConditionalGeneration",), "llama", False,
            _COMMON | {"image_seq_length", "projector_hidden_act", "vision_feature_select_strategy",
                       "vision_feature_layer", "multimodal_projector_bias"}),
    Wrapper("llama4", ("Llama4ForConditionalGeneration",), "llama4_text", False,
            _COMMON | {"boi_token_index", "eoi_token_index", "boi_token_id", "eoi_token_id"}),
    Wrapper("kimi_k25", ("Kimi_K25ForConditionalGeneration", "KimiK25ForConditionalGeneration"), "deepseek_v3",
            True, _COMMON | {"projection_hidden_size", "projection_layer_norm_eps", "video_token_id",
                             "vision_start_token_id", "vision_end_token_id", "media_placeholder_token_id"}),
)}
"""model_type -> the image-text wrapper whose text decoder Kiln exports."""

NOT_YET = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text", "gemma4": "gemma4_text",
           "qwen2_vl": "qwen2 with multimodal rope (mrope)",
           "qwen2_5_vl": "qwen2 with multimodal rope (mrope)", "qwen3_vl": "qwen3 with multimodal rope (mrope)",
           "qwen3_vl_moe": "qwen3_moe with multimodal rope (mrope)"}
"""Image-text model_types whose text decoder is of a family Kiln does not compute yet: refused, naming it."""

TEXT_ALIASES = {"kimi_k2": "deepseek_v3"}
"""text_config model_types transformers reads as another (Kimi_K25Config: kimi_k2 is DeepSeek-V3)."""

TEXT_DEFAULTS = {
    "gemma3_text": {"vocab_size": 262208, "hidden_size": 2304, "intermediate_size": 9216, "num_hidden_layers": 26,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256},
    "mistral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                "num_attention_heads": 32, "num_key_value_heads": 8, "sliding_window": 4096},
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32},
    "deepseek_v3": {"vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432, "num_hidden_layers": 61,
                    "num_attention_heads": 128},
}
"""What the text config class assumes for a size a published text_config leaves out (Gemma 3's lists only
what differs from Gemma3TextConfig's): tests/unit/test_hf_config_multimodal.py holds these to transformers'."""

_TEXT_PREFIXES = (("language_model.model.", "model."), ("model.language_model.", "model."),
                  ("language_model.lm_head.", "lm_head."), ("lm_head.", "lm_head."))
"""A checkpoint's text-decoder prefix -> the decoder's own: save_pretrained's layout, then transformers 5's."""


def wrapper_of(raw: dict) -> Wrapper | None:
    """The image-text wrapper a config.json describes (by model_type, else its one class), else None; BadInput
    for one whose text decoder Kiln does not compute yet."""
    model_type = raw.get("model_type")
    archs = raw.get("architectures")
    if model_type is None and isinstance(archs, list) and len(archs) == 1:
        model_type = next((w.name for w in WRAPPERS.values() if archs[0] in w.classes), None)
    if model_type in NOT_YET:
        raise BadInput(f"config.json: model_type={model_type!r} is an image-text checkpoint whose text decoder is "
                       f"{NOT_YET[model_type]}, which Kiln does not export yet; Kiln exports the text decoder of "
                       f"{', '.join(sorted(WRAPPERS))} checkpoints.")
    return WRAPPERS.get(model_type)


def text_decoder(raw: dict) -> dict:
    """The config.json of the checkpoint's text decoder: `raw` itself for a text-only checkpoint; for an
    image-text one its text_config (model_type and the text class's size defaults filled in), tied as the outer
    config says, with the outer dtype and quantization_config. BadInput naming an outer field Kiln does not
    know, or a text_config that is missing."""
    wrapper = wrapper_of(raw)
    if wrapper is None:
        return raw
    archs = raw.get("architectures")
    if archs is not None and (not isinstance(archs, list) or len(archs) != 1 or archs[0] not in wrapper.classes):
        raise BadInput(f"config.json: architectures={archs!r} is not supported for model_type {wrapper.name!r}; "
                       f"Kiln exports the text decoder of {wrapper.classes[0]}.")
    unknown = sorted(set(raw) - wrapper.fields)
    if unknown:
        raise BadInput(f"config.json: {', '.join(unknown[:4])}: Kiln does not know what "
                       f"{'this field changes' if len(unknown) == 1 else 'these fields change'} in a {wrapper.name} "
                       "checkpoint, so it cannot say its text decoder computes what the checkpoint does.")
    text = raw.get("text_config")
    if not isinstance(text, dict):
        raise BadInput(f"config.json: a {wrapper.name} checkpoint's text decoder is described by text_config, "
                       f"which is {'missing' if text is None else f'{text!r}'}; restore the checkpoint's config.json.")
    text_type = TEXT_ALIASES.get(text.get("model_type"), text.get("model_type") or wrapper.text_type)
    out = {**TEXT_DEFAULTS.get(text_type, {}),
           **{k: v for k, v in text.items() if k not in ("architectures", "tie_word_embeddings")},
           "model_type": text_type,
           "tie_word_embeddings": raw.get("tie_word_embeddings", wrapper.tie_word_embeddings)}
    for key in ("dtype", "torch_dtype", "quantization_config"):
        if raw.get(key) is not None:
            out[key] = raw[key]
    return out


def decoder_names(names) -> tuple[dict[str, str], list[str]]:
    """(checkpoint name -> the text decoder's name, for the tensors under a text-decoder prefix; the other
    names, sorted: the vision tower's and the projector's, which Kiln leaves out)."""
    mapped: dict[str, str] = {}
    left_out = []
    for name in names:
        prefix = next((p for p in _TEXT_PREFIXES if name.startswith(p[0])), None)
        if prefix is None:
            left_out.append(name)
        else:
            mapped[name] = prefix[1] + name[len(prefix[0]):]
    return mapped, sorted(left_out)


def text_tensors(raw: dict, tensors: dict[str, T], nbytes: Callable[[T], int]) -> tuple[
        dict[str, T], dict[str, str], dict | None]:
    """A checkpoint's tensors as its text decoder names them, given its config.json `raw`: (decoder name -> the
    entry of `tensors`, decoder name -> the checkpoint's name, and for an image-text checkpoint
    {'left_out': the report's sentence on what was left out, 'prefixes': decoder prefix -> the checkpoint's}).
    A text-only checkpoint's come back as they are (no renames, None). `nbytes`: an entry's size, for the
    sentence."""
    wrapper = wrapper_of(raw) if isinstance(raw, dict) else None
    if wrapper is None:
        return tensors, {}, None
    mapped, left_out = decoder_names(tensors)
    named = {}
    for old, new in sorted(mapped.items()):
        if new in named:
            raise BadInput(f"the checkpoint holds both {named[new]} and {old}, one tensor of its text decoder under "
                           "two names; keep one.")
        named[new] = old
    dropped = set(left_out)
    dropped_bytes = sum(nbytes(t) for n, t in tensors.items() if n in dropped)
    prefixes = {}
    for new, old in named.items():
        head = new.split(".", 1)[0] + "."
        prefixes.setdefault(head, set()).add(old[:len(old) - len(new) + len(head)])
    mixed = sorted(head for head, spelled in prefixes.items() if len(spelled) > 1)
    if mixed:
        raise BadInput(f"the checkpoint's text decoder tensors under {mixed[0]} are spelled with several prefixes "
                       f"({', '.join(sorted(prefixes[mixed[0]]))}); keep one layout.")
    return ({new: tensors[old] for new, old in named.items()}, named,
            {"left_out": _left_out_sentence(wrapper, left_out, dropped_bytes),
             "prefixes": {head: spelled.pop() for head, spelled in sorted(prefixes.items())}})


def stored_name(name: str, prefixes: dict[str, str] | None) -> str:
    """A text decoder's tensor `name` as its checkpoint spells it (`prefixes`: text_tensors'; None: the same)."""
    if not prefixes:
        return name
    head = name.split(".", 1)[0] + "."
    return prefixes.get(head, head) + name[len(head):]


def _left_out_sentence(wrapper: Wrapper, left_out: list[str], nbytes: int) -> str:
    """The report's words for an image-text checkpoint's export."""
    parts = sorted({n.split(".", 2)[1] if n.startswith("model.") else n.split(".", 1)[0] for n in left_out})
    return (f"{wrapper.classes[0]} checkpoint: Kiln exported its text decoder and left out "
            f"{len(left_out)} tensors ({nbytes / 2**20:.1f} MiB: {', '.join(parts) or 'none'}), the vision tower "
            "and its projector; the export takes token ids only.")
