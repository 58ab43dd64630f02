"""Hugging Face `config.json` -> ModelConfig, by an allow-list, and back.

Pure: no torch import. Every field of a config.json is one of:
- read: mapped onto a ModelConfig field (and so into every forward key);
- checked: accepted only with the value Kiln computes (`hidden_act: silu`);
- inert: does not change what one forward step computes (token ids, the
  initializer, dropout, which is off at inference, ...; common.INERT says why
  for each);
and any other field is bad input, named with its value, before anything
starts. So a field Kiln does not know can never be silently ignored.

Both spellings are read: transformers 4.x (top-level `rope_theta`,
`rope_scaling`, `torch_dtype`) and transformers 5 (`rope_parameters`,
`dtype`); to_hf writes the 4.x spelling.

Modules: `common` (the Family record, INERT, the readers of one value),
`rope` (rope types default, linear, llama3 and yarn), one module per family
group, each reading as its transformers config class does (`llama`: Llama,
Mistral; `qwen`: Qwen2, Qwen3, Qwen2-MoE, Qwen3-MoE; `mixtral`; `gemma`:
Gemma 2, Gemma 3; `phi3`; `deepseek`: DeepSeek-V3; `deepseek_v4`: DeepSeek-V4; `gpt_oss`;
`minimax`: MiniMax-M2; `mistral4`; `llama4`: Llama 4's text decoder; `dsa`: DeepSeek-V3.2, GLM-5), `quantization`
(`quantization_config`: FP8 blocks, any other format refused by name), `multimodal` (the text decoder
of an image-text checkpoint: its text_config, its weights' names) and
`dispatch` (the table of families, from_hf and to_hf). A new family is one module and one
entry in dispatch.FAMILIES.
"""

from kiln.core.model.hf_config.dispatch import from_hf, to_hf

__all__ = ["from_hf", "to_hf"]
