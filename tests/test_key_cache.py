"""Block keys reused across a conversation's turns (kvcore.keys.KeyChainCache through the router's
IndexAnnotator): every key must equal a full re-hash of the prompt, and only new blocks are hashed."""

from __future__ import annotations

import random
from typing import Any

from kvcore import sim_tokenizer
from kvcore.keys import KeyChainCache, block_keys, common_blocks, request_extra_keys
from policies.base import RouteRequest
from router.config import RouterConfig, TokenizerConfig
from router.routing import CHAT, RouteContext
from router.service import IndexAnnotator
from router.tokenize import SimChatTokenizer


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
        assert tokens == sim_tokenizer.encode_chat(messages)
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
    assert stats["entries"] == 1  # each turn's names replaced the entry it extended


async def test_one_growing_message_reuses_the_tokens_and_keys_of_its_earlier_version() -> None:
    """Trace replays and some agent frameworks resend one user message that grows by appending:
    no message prefix is shared, only the content's cuts."""
    annotator = _annotator()
    text = ""
    previous_blocks = 0
    hashed_before = 0
    for step in range(1, 6):
        # Each step appends 2,500 tokens and a 2-byte character (it shifts the 3-byte chunks).
        text += sim_tokenizer.filler_text(2500, seed=step) + "é"
        messages = [{"role": "system", "content": "tools: none"}, {"role": "user", "content": text}]
        keys, tokens = await _keys_of(annotator, {"model": "m", "messages": messages})
        assert tokens == sim_tokenizer.encode_chat(messages)
        assert keys == block_keys(tokens, 16, parent=7)
        stats = annotator.key_cache_stats()
        hashed_now, hashed_before = stats["hashed_blocks"] - hashed_before, stats["hashed_blocks"]
        if step > 1:
            # The new text and the last block of the old prompt (it ended with the template's tail).
            assert hashed_now <= len(tokens) // 16 - previous_blocks + 1, step
        previous_blocks = len(tokens) // 16
    assert annotator.key_cache_stats()["hits"] == 4
    assert annotator.key_cache_stats()["entries"] == 1
    tokenizer_stats = annotator._tokenizer.cache_stats()
    assert tokenizer_stats["cut_hits"] == 4


async def test_another_salt_or_an_edited_history_is_never_reused() -> None:
    annotator = _annotator()
    messages = [{"role": "user", "content": sim_tokenizer.filler_text(400, seed=1)}]
    first, _ = await _keys_of(annotator, {"model": "m", "messages": messages, "cache_salt": "a"})
    other, tokens = await _keys_of(annotator, {"model": "m", "messages": messages, "cache_salt": "b"})
    assert other != first
    salted = request_extra_keys(len(tokens) // 16, cache_salt="b")
    assert other == block_keys(tokens, 16, parent=7, extra_keys=salted)
    # A cached prompt that differs in block 1 gives back block 0 only, whatever anchor found it.
    cache = KeyChainCache(1 << 20)
    tokens = list(range(100))
    edited = [*tokens[:20], -1, *tokens[21:60]]
    cache.put([11], "s", edited, block_keys(edited, 16))
    assert cache.reusable([11, 12], "s", tokens, 16) == (block_keys(tokens, 16)[:1], None)
    assert cache.reusable([11, 12], "other scope", tokens, 16) == ([], None)
    cache.put([11], "s", tokens[:60], block_keys(tokens[:60], 16))
    assert cache.reusable([11, 12], "s", tokens, 16)[0] == block_keys(tokens, 16)[:3]
    assert cache.stats()["entries"] == 1  # the edited entry lost its only name


async def test_a_repeated_prompt_is_known_by_identity_and_a_one_token_change_never_is() -> None:
    """A repeat gets the tokenizer's very list back (so the key cache skips its token check); a
    prompt of the same length with one character changed in the middle or at the end is a new
    list whose keys are its own full hash. Catches a shortcut that takes an equal-length or
    equally-named prompt for the cached one (stale keys), and a tokenizer that copies the list
    on a whole-prompt hit (the O(prompt) check comes back)."""

    def body(content: str) -> dict[str, Any]:
        return {
            "model": "m",
            "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": content}],
        }

    annotator = _annotator()
    text = sim_tokenizer.filler_text(4000, seed=3)
    while len(sim_tokenizer.encode_chat(body(text)["messages"])) % 16:  # the last token in a full block
        text = text[:-1]

    keys, tokens = await _keys_of(annotator, body(text))
    again_keys, again = await _keys_of(annotator, body(text))
    assert again is tokens and again_keys == keys
    middle = len(text) // 2
    for edited in (text[:-1] + ("x" if text[-1] != "x" else "y"), text[:middle] + "Q" + text[middle + 1 :]):
        assert len(edited) == len(text) and edited != text
        edited_keys, edited_tokens = await _keys_of(annotator, body(edited))
        assert edited_tokens is not tokens and len(edited_tokens) == len(tokens)
        assert edited_tokens == sim_tokenizer.encode_chat(body(edited)["messages"])
        assert edited_keys == block_keys(edited_tokens, 16, parent=7)
        assert edited_keys != keys
        # The cached original still answers for the original.
        assert (await _keys_of(annotator, body(text)))[0] == keys
    # The cache itself, without the tokenizer: an equal-length list one token off at the end or in
    # the middle shares only the blocks before the change; the cached list itself shares all.
    cache = KeyChainCache(1 << 20)
    cached = list(range(96))
    cache.put([1], "s", cached, block_keys(cached, 16))
    assert cache.reusable([1], "s", cached, 16)[0] == block_keys(cached, 16)
    for position in (95, 50):
        changed = list(cached)
        changed[position] = -1
        assert cache.reusable([1], "s", changed, 16)[0] == block_keys(cached, 16)[: position // 16]


def test_common_blocks_finds_the_first_differing_block() -> None:
    rng = random.Random(5)
    for _ in range(300):
        a = [rng.randrange(1000) for _ in range(rng.randrange(0, 200))]
        b = list(a[: rng.randrange(0, len(a) + 1)])
        b += [rng.randrange(1000, 2000) for _ in range(rng.randrange(0, 50))]
        brute = 0
        while (brute + 1) * 16 <= min(len(a), len(b)) and a[brute * 16 : (brute + 1) * 16] == b[
            brute * 16 : (brute + 1) * 16
        ]:
            brute += 1
        limit = rng.randrange(0, 15)
        assert common_blocks(a, b, 16, limit) == min(brute, limit)


def test_the_cache_stays_within_its_byte_bound() -> None:
    cache = KeyChainCache(200_000)
    for conversation in range(50):
        tokens = list(range(conversation, conversation + 1600))
        cache.put([conversation, 1000 + conversation], "s", tokens, block_keys(tokens, 16))
        assert cache.size_bytes <= 200_000
    stats = cache.stats()
    assert 0 < stats["entries"] < 50 and stats["names"] == 2 * stats["entries"]
    # Larger than the whole bound: not kept at all.
    big = list(range(10_000))
    cache.put([99], "s", big, block_keys(big, 16))
    assert cache.reusable([99], "s", big, 16) == ([], None)


def test_a_prompt_filed_again_keeps_its_entry_and_a_new_name_is_filed() -> None:
    """``put`` of the very entry ``reusable`` handed back (its token list, its key list) under its
    own names changes nothing but the counters; under a name it lacks (the same prompt reached by
    another message split), or with another token list, it is filed as before. Catches the
    shortcut taken without checking the names or the tokens."""
    cache = KeyChainCache(1 << 20)
    tokens = list(range(160))
    keys = block_keys(tokens, 16)
    cache.put([1, 2], "s", tokens, keys)
    reused, extended = cache.reusable([1, 2], "s", tokens, 16)
    assert reused is keys and extended is not None
    cache.put([1, 2], "s", tokens, reused, reused_blocks=10, replaces=extended)
    assert (cache.stats()["entries"], cache.stats()["names"], cache.stats()["reused_blocks"]) == (1, 2, 10)
    assert cache.reusable([2], "s", tokens, 16)[0] is keys
    # A new name: filed (and the entry it extends replaced, as before).
    reused, extended = cache.reusable([1, 2], "s", tokens, 16)
    cache.put([3], "s", tokens, reused, reused_blocks=10, replaces=extended)
    assert cache.reusable([3], "s", tokens, 16)[0] == keys
    # An equal prompt in another list: filed by that list (its blocks are checked against it).
    again = list(tokens)
    reused, extended = cache.reusable([3], "s", again, 16)
    cache.put([3], "s", again, reused, reused_blocks=10, replaces=extended)
    changed = [*tokens[:-1], -1]
    again[-1] = -1  # the caller must not change a filed list; this shows which list is held
    assert cache.reusable([3], "s", changed, 16)[0] == keys


def test_refiled_counts_a_repeat_as_reusable_then_put_would() -> None:
    """A prompt sent again (the very token list, filed under every one of its names) gets its keys
    from ``refiled`` with the same counters and LRU order as ``reusable`` then ``put``; any other
    prompt gets None and nothing counted. Catches the shortcut answering for another token list,
    a missing name, a partial key list, or skipping the counters or the recency."""

    def filled() -> tuple[KeyChainCache, list[int], list[int], list[int]]:
        cache = KeyChainCache(1 << 20)
        tokens, other = list(range(168)), list(range(1000, 1168))
        cache.put([1, 2], "s", tokens, block_keys(tokens, 16))
        cache.put([5], "s", other, block_keys(other, 16))  # more recent than the first
        return cache, tokens, other, block_keys(tokens, 16)

    slow, tokens, _, keys = filled()
    reused, extended = slow.reusable([0, 2, 1], "s", tokens, 16)  # the whole prompt's name last
    slow.put([1, 2], "s", tokens, reused, reused_blocks=len(reused), replaces=extended)
    fast, tokens_fast, _, _ = filled()
    assert fast.refiled([1, 2], "s", tokens_fast, 16) == keys
    assert fast.stats() == slow.stats() and fast.stats()["hits"] == 1
    assert list(fast._entries) == list(slow._entries)  # the repeat is the most recent entry now
    before = fast.stats()
    assert fast.refiled([1, 2], "s", list(tokens_fast), 16) is None  # an equal list, not the one filed
    assert fast.refiled([1, 3], "s", tokens_fast, 16) is None  # a name it is not filed under
    assert fast.refiled([1, 2], "t", tokens_fast, 16) is None  # another scope
    assert fast.refiled([1, 2], "s", tokens_fast, 8) is None  # keys of another block size
    assert fast.refiled([], "s", tokens_fast, 16) is None
    assert fast.stats() == before
    partial = KeyChainCache(1 << 20)
    partial.put([1], "s", tokens_fast, keys[:5])
    assert partial.refiled([1], "s", tokens_fast, 16) is None


async def test_a_message_grown_by_many_cuts_finds_its_earlier_version_in_every_content_form() -> None:
    """A growing message whose earlier version is many cuts below its deepest cut: the lookup walks
    down past the cuts it names one by one into the one-pass naming of every cut (router/tokenize.py
    ``CutNames``), and must still find the earlier prompt's deepest cut, named one by one when it was
    filed. Content with JSON escapes' characters, non-ASCII and a list of text parts. Catches the
    one-pass names differing from the one-by-one names (a wrong slice or seed: the earlier cut
    is never found, tokens are encoded whole and nothing is reused)."""
    grown = sim_tokenizer.filler_text(7000, seed=3)  # ~21,000 bytes: about 7 cuts past the start
    for shape in ("escapes", "non-ascii", "parts"):
        annotator = _annotator()
        text = 'a "quoted" line\n\ttab \\ backslash \u2028 ' + sim_tokenizer.filler_text(3000, seed=1)
        if shape == "non-ascii":
            text = text.replace("e", "é").replace("o", "😀")
        for step in range(2):
            content: Any = text if shape != "parts" else [{"type": "text", "text": text}]
            messages = [{"role": "user", "content": content}]
            keys, tokens = await _keys_of(annotator, {"model": "m", "messages": messages})
            assert tokens == sim_tokenizer.encode_chat(messages), (shape, step)
            assert keys == block_keys(tokens, 16, parent=7), (shape, step)
            text += grown
        assert annotator._tokenizer.cache_stats()["cut_hits"] == 1, shape
        stats = annotator.key_cache_stats()
        assert stats["hits"] == 1 and stats["reused_blocks"] > 0, shape
