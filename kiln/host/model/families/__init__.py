"""One module per family's decoder layer, assembled from kiln.host.model.layers, read top to bottom.

Purpose: `llama` (Llama, Mistral, Qwen2, Qwen3, Phi-3, Mixtral, Qwen2-MoE,
Qwen3-MoE), `gemma` (Gemma 2 and 3), `deepseek` (DeepSeek-V3) and
`deepseek_v4` (its own decoder over a slot cache).

Contracts: a new family is one module here (and its config reader in
kiln.core.model.hf_config); it imports the shared layers, never another
family's internals beyond its layer function.
"""
