"""The device check's transformers model: a random-init LlamaForCausalLM written with save_pretrained.

bfloat16, head_dim 128, grouped-query attention (kv heads < heads, 2 of them so
tp 2 splits them), 4 layers. On a GPU its sizes are a small real model's
(hidden 1024, vocabulary 32000); on the CPU, and with --quick, narrower, so the
check runs in minutes on two cores. Nothing is downloaded.
"""

from __future__ import annotations

from pathlib import Path

COMMON = dict(num_hidden_layers=4, head_dim=128, num_key_value_heads=2, max_position_embeddings=512,
              initializer_range=0.05, rope_theta=10000.0, tie_word_embeddings=False)
SIZES = {
    "cuda": dict(hidden_size=1024, num_attention_heads=8, intermediate_size=2816, vocab_size=32000),
    "cpu": dict(hidden_size=512, num_attention_heads=4, intermediate_size=1024, vocab_size=8192),
    "quick": dict(hidden_size=512, num_attention_heads=4, intermediate_size=512, vocab_size=2048),
}
"""Per device (or 'quick'): the sizes that differ."""

PROMPT_TOKENS = 8
"""Tokens of the prompt compared with transformers (the compared bucket is 1 x PROMPT_TOKENS)."""


def write_llama(path: Path, size: str, seed: int = 0) -> dict:
    """Write the model of `size` (a SIZES key) under `path` with save_pretrained, in bfloat16; returns its
    config overrides. Norms are randomised around 1, so they matter in every output."""
    import torch
    import transformers

    overrides = {**COMMON, **SIZES[size]}
    config = transformers.LlamaConfig(**overrides)
    config.dtype = torch.bfloat16
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(torch.randn_like(p) * 0.1 + 1.0)
    model.to(torch.bfloat16).save_pretrained(path)
    return overrides


def prompt(vocab_size: int, seed: int = 3) -> list[int]:
    """The prompt both sides run: PROMPT_TOKENS token ids drawn with `seed`."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (PROMPT_TOKENS,), generator=gen).tolist()


def reference_logits(path: Path, tokens: list[int], dtype: str, device: str):
    """transformers' logits [1, len(tokens), vocab] of `tokens` from position 0, the model loaded from
    `path` in `dtype` and run on `device`; returned in float32 on the CPU."""
    import torch
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype)).to(device).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens], device=device)).logits
    return logits.float().cpu()


def prefill_args(cfg, tp: int, tokens: list[int], *, page_tokens: int, pages_per_seq: int, device: str):
    """One rank's inputs for `tokens` from position 0 (an empty cache: nothing cached is visible)."""
    import torch

    from kiln.host.model import example_inputs

    args = list(example_inputs(cfg, tp, 1, len(tokens), page_tokens=page_tokens, pages_per_seq=pages_per_seq,
                               num_pages=pages_per_seq + 2))
    args[0] = torch.tensor([tokens], dtype=args[0].dtype)
    args[1] = torch.zeros_like(args[1])
    return tuple(a.to(device) for a in args)
