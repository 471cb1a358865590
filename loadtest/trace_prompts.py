"""Chat prompts for trace replay against a live endpoint: a trace gives each request only a chain of
block ids; each id becomes a fixed text of exactly one block of simulator tokens, so requests that
share a prefix of ids share a prefix of tokens (and of engine KV blocks), and others share none.
"""

from __future__ import annotations

from kvcore.sim_tokenizer import CHARS_PER_TOKEN, filler_text


def block_text(block_id: int, block_size: int) -> str:
    """Text of exactly ``block_size`` simulator tokens, unique per block id (the tag) so two ids never
    render the same block content; equal id chains render equal text."""
    tag = f"<{block_id:x}>"
    n_chars = block_size * CHARS_PER_TOKEN
    return (tag + filler_text(block_size, seed=block_id % 1_000_003))[:n_chars]


def trace_messages(block_ids: list[int], block_size: int, prompt_tokens: int) -> list[dict[str, str]]:
    """One user message whose text repeats the trace's block chain (so prompts that share a prefix of
    ids share a prefix of tokens), padded to ``prompt_tokens`` (the template adds 3 tokens)."""
    text = "".join(block_text(b, block_size) for b in block_ids)
    pad_tokens = max(0, prompt_tokens - 3 - len(block_ids) * block_size)
    tail = filler_text(pad_tokens, seed=len(block_ids)) if pad_tokens else ""
    return [{"role": "user", "content": text + tail}]
