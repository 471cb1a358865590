"""Block keys reused across a conversation's turns (kvcore.keys.KeyChainCache through the router's
IndexAnnotator): every key must equal a full re-hash of the prompt, and only new blocks are hashed."""

from __future__ import annotations

from typing import Any

from kvcore import sim_tokenizer
from kvcore.keys import KeyChainCache, block_keys, request_extra_keys
from policies.base import RouteRequest
from router.config import RouterConfig, TokenizerConfig
from router.routing import CHAT, RouteContext
from router.service import IndexAnnotator
from router.tokenize import SimChatTokenizer, prefix_hashes


def _annotator(cache_max_bytes: int = 64 << 20) -> IndexAnnotator:
    config = RouterConfig(tokenizer=TokenizerConfig(backend="sim", cache_max_bytes=cache_max_bytes))
    return IndexAnnotator(config, SimChatTokenizer(), None, namespace=7, lora_of=lambda model: None)


async def _keys_of(annotator: IndexAnnotator, body: dict[str, Any]) -> tuple[list[int], list[int]]:
    ctx = RouteContext(
        request_id="r",
        endpoint=CHAT,
        raw_body=b"",
        body=body,
        stream=False,
        route_request=RouteRequest(request_id="r", model="m"),
        started_s=0.0,
    )
    await annotator.annotate(ctx)
    assert ctx.prompt_token_ids is not None
    return list(ctx.route_request.block_keys), ctx.prompt_token_ids


async def test_a_conversation_hashes_only_its_new_blocks_and_every_key_is_the_full_hash() -> None:
    annotator = _annotator()
    messages: list[dict[str, str]] = [{"role": "system", "content": "answer briefly"}]
    hashed_before = 0
    previous_blocks = 0
    for turn in range(1, 6):
        messages.append({"role": "user", "content": sim_tokenizer.filler_text(700, seed=turn)})
        body = {"model": "m", "messages": list(messages), "cache_salt": "tenant-a"}
        keys, tokens = await _keys_of(annotator, body)
        # The independent truth: the whole prompt hashed from scratch, salt on block 0.
        extra = request_extra_keys(len(tokens) // 16, cache_salt="tenant-a")
        assert keys == block_keys(tokens, 16, parent=7, extra_keys=extra)
        stats = annotator.key_cache_stats()
        hashed_now = stats["hashed_blocks"] - hashed_before
        hashed_before = stats["hashed_blocks"]
        # Only the blocks past the previous prompt's last full block are hashed.
        assert hashed_now == len(tokens) // 16 - previous_blocks, turn
        previous_blocks = len(tokens) // 16
        messages.append({"role": "assistant", "content": sim_tokenizer.filler_text(40, seed=100 + turn)})
    stats = annotator.key_cache_stats()
    assert stats["hits"] == 4 and stats["misses"] == 1
    assert stats["reused_blocks"] > 3 * stats["hashed_blocks"] // 2
    assert stats["entries"] == 1  # each turn replaced the entry it extended


async def test_another_salt_or_an_edited_history_is_never_reused() -> None:
    annotator = _annotator()
    messages = [{"role": "user", "content": sim_tokenizer.filler_text(400, seed=1)}]
    first, _ = await _keys_of(annotator, {"model": "m", "messages": messages, "cache_salt": "a"})
    other, tokens = await _keys_of(annotator, {"model": "m", "messages": messages, "cache_salt": "b"})
    assert other != first
    assert other == block_keys(
        tokens, 16, parent=7, extra_keys=request_extra_keys(len(tokens) // 16, cache_salt="b")
    )
    # A cache entry whose tokens differ from the prompt in an early block (a template that is
    # not prefix-stable) gives nothing back, even under the right anchor.
    cache = KeyChainCache(1 << 20)
    tokens = list(range(100))
    anchors = [11, 12]
    cache.put(anchors[:1], "s", [*tokens[:20], -1, *tokens[21:60]], block_keys(tokens[:60], 16))
    assert cache.reusable(anchors, "s", tokens, 16) == ([], None)
    assert cache.reusable(anchors, "other scope", tokens, 16) == ([], None)
    cache.put(anchors[:1], "s", tokens[:60], block_keys(tokens[:60], 16))
    reused, found = cache.reusable(anchors, "s", tokens, 16)
    assert reused == block_keys(tokens, 16)[:3] and found == 11


def test_the_cache_stays_within_its_byte_bound() -> None:
    cache = KeyChainCache(20_000)
    for conversation in range(50):
        tokens = list(range(conversation, conversation + 1600))
        cache.put(
            prefix_hashes([{"role": "user", "content": str(conversation)}]),
            "s",
            tokens,
            block_keys(tokens, 16),
        )
        assert cache.size_bytes <= 20_000
    assert 0 < cache.stats()["entries"] < 50
    # Larger than the whole bound: not kept at all.
    big = list(range(10_000))
    cache.put([99], "s", big, block_keys(big, 16))
    assert cache.reusable([99], "s", big, 16) == ([], None)
