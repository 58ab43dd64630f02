"""How a server would feed a prompt through an export's buckets: pure scheduling, no torch.

A step processes `n` new tokens of one sequence in a bucket of `tokens >= n`
(padded at the end: later positions never affect earlier ones under the
causal mask) or, when no bucket is that wide, the prompt is cut into chunks
of the widest bucket (chunked prefill). A slot cache (DeepSeek-V4's: state
that every token of a step rewrites) takes no padding: its prompt is cut
into chunks that fill their buckets exactly. Decode steps feed one token each in
the narrowest bucket.

A model whose rotary frequencies go by the sequence's length takes it as
`seq_lens`: the prompt's whole length while the prompt is fed, a decoded
token's position + 1 after (what transformers reads as max(position_ids) + 1
of each call). Phi-3's longrope switches from its short to its long factors
once a sequence passes original_max_position_embeddings, and then the keys
cached under the short ones no longer hold: as transformers' Phi-3 does in
generate(), the whole sequence is fed again at that length (`refills_cache`).
"""

from __future__ import annotations

from dataclasses import dataclass

from kiln.core.model.config import ModelConfig
from kiln.core.errors import BadInput
from kiln.core.plan.recipe import Bucket


@dataclass(frozen=True)
class Step:
    """One forward call: tokens [start, start + count) of the sequence, in `bucket`."""

    start: int
    count: int
    bucket: Bucket


def pick_bucket(buckets: list[Bucket], count: int) -> Bucket:
    """The narrowest bucket that takes `count` tokens of one sequence (the smallest batch among equals)."""
    fits = [b for b in buckets if b.tokens >= count]
    if not fits:
        raise ValueError(f"no bucket takes {count} tokens")
    return min(fits, key=lambda b: (b.tokens, b.batch))


def step_bucket(buckets: list[Bucket], count: int, *, padded: bool = True) -> Bucket:
    """The bucket a step of `count` tokens runs in: pick_bucket's, or with `padded` False (a slot cache) the
    narrowest of exactly `count` tokens; ValueError when there is none."""
    if padded:
        return pick_bucket(buckets, count)
    exact = [b for b in buckets if b.tokens == count]
    if not exact:
        raise ValueError(f"no bucket takes exactly {count} tokens, and a slot cache (DeepSeek-V4's) takes no "
                         "padding: export with a bucket of 1 token (every decode step's)")
    return min(exact, key=lambda b: b.batch)


def prefill_steps(buckets: list[Bucket], prompt_len: int, *, padded: bool = True) -> list[Step]:
    """The steps that feed a prompt of `prompt_len` tokens, chunked by the widest bucket. `padded` False (a
    slot cache, DeepSeek-V4's, whose state every token of a step rewrites: padding would be fed as tokens):
    each step fills its bucket's tokens exactly, the widest bucket that fits what is left (a one-token
    bucket, as every export's decode bucket, finishes any prompt)."""
    widest = max(b.tokens for b in buckets)
    steps, start = [], 0
    while start < prompt_len:
        count = min(widest, prompt_len - start)
        if not padded:
            count = max((b.tokens for b in buckets if b.tokens <= count), default=count)
        steps.append(Step(start, count, step_bucket(buckets, count, padded=padded)))
        start += count
    return steps


def refills_cache(cfg: ModelConfig, length: int) -> bool:
    """Whether a sequence that has just grown to `length` tokens must be fed again from its start (its cache
    rebuilt, `seq_lens` = `length`) rather than by one decode step: a longrope model's first step past its
    original context (transformers' Phi3ForCausalLM.prepare_inputs_for_generation drops its cache then)."""
    return cfg.rope_type == "longrope" and length == cfg.rope_original_max_position + 1


def check_request(prompt: list[int], max_new_tokens: int, *, vocab_size: int, context_tokens: int) -> None:
    """BadInput unless the prompt's ids are in the vocabulary and prompt + generated tokens fit the context."""
    if not prompt:
        raise BadInput("--tokens is empty; give the prompt as comma-separated token ids, e.g. --tokens 1,2,3.")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise BadInput(f"--tokens: id {bad[0]} is outside the model's vocabulary (0..{vocab_size - 1}).")
    if max_new_tokens < 1:
        raise BadInput(f"--max-new-tokens must be at least 1, got {max_new_tokens}.")
    # The last generated token is never fed back, so the cache holds prompt + max_new_tokens - 1 tokens.
    need = len(prompt) + max_new_tokens - 1
    if need > context_tokens:
        raise BadInput(f"a {len(prompt)}-token prompt plus {max_new_tokens} new tokens needs {need} tokens of "
                       f"context, but the export was made for {context_tokens} (max_context_tokens); shorten "
                       "the request or export with a larger --set max_context_tokens.")


def parse_tokens(text: str) -> list[int]:
    """'1,2,3' -> [1, 2, 3]; BadInput on anything else."""
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t != ""]
    except ValueError:
        raise BadInput(f"--tokens {text!r}: expected comma-separated token ids, e.g. 1,2,3.") from None
