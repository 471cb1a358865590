"""Tokenisation back-ends: a tiny local HF tokenizer (WordLevel + jinja template built here, no
downloads), the simulator's tokenizer, and an engine's /tokenize served by a real aiohttp server."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import aiohttp
import pytest
import xxhash
from aiohttp import web
from tokenizers import AddedToken, Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace

from kvcore import sim_tokenizer
from router.tokenize import (
    CUT_BYTES,
    CutNames,
    EngineChatTokenizer,
    HfChatTokenizer,
    PromptNames,
    SimChatTokenizer,
    content_cuts,
    prefix_hashes,
)

TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m.role not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
    "<|{{ m.role }}|> {{ m.content }} <|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
WORDS = "hello world how are you fine thanks and what about kv cache blocks stay warm".split()


@pytest.fixture
def tokenizer_dir(tmp_path: Path) -> Path:
    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(WORDS)}}
    tok = Tokenizer(WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = Whitespace()
    tok.add_special_tokens(
        [AddedToken(t, special=True) for t in ["<s>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]]
    )
    tok.save(str(tmp_path / "tokenizer.json"))
    config = {"chat_template": TEMPLATE, "bos_token": {"content": "<s>"}, "eos_token": "<|end|>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def conversation(turns: int) -> list[dict[str, str]]:
    msgs = [{"role": "system", "content": "kv cache blocks stay warm"}]
    for i in range(turns):
        msgs.append({"role": "user", "content": f"hello world how are you {WORDS[i % len(WORDS)]}"})
        msgs.append({"role": "assistant", "content": "fine thanks and what about you"})
    return msgs


async def test_hf_tokenizer_matches_full_encode_and_reuses_prefix(tokenizer_dir: Path) -> None:
    reference = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    hf = HfChatTokenizer.from_dir(tokenizer_dir)
    for turns in range(1, 6):
        msgs = conversation(turns)[:-1]  # ends with the user turn
        text = hf.render(msgs, add_generation_prompt=True)
        assert text.startswith("<s><|system|>") and text.endswith("<|assistant|>")
        got = await hf.chat_tokens(msgs)
        assert got == reference.encode(text, add_special_tokens=False).ids
        assert 0 not in got  # every word known: nothing mapped to [UNK]
        msgs_with_answer = conversation(turns)
        assert (
            await hf.chat_tokens(msgs_with_answer)
            == reference.encode(
                hf.render(msgs_with_answer, add_generation_prompt=True), add_special_tokens=False
            ).ids
        )
    stats = hf.cache_stats()
    assert stats["hits"] >= 8 and stats["entries"] >= 5
    with pytest.raises(ValueError, match="bad role"):
        await hf.chat_tokens([{"role": "robot", "content": "hello"}])


async def test_hf_tokenizer_ignores_stored_truncation_and_padding(tokenizer_dir: Path) -> None:
    """transformers (so vLLM) ignores the truncation and padding a tokenizer.json stores; the router
    honoured them and cut every prompt to max_length (the blind-routing bug of issue 29)."""
    plain = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    stored = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    stored.enable_truncation(max_length=8)
    stored.enable_padding(pad_id=0, pad_token="[UNK]", length=12)
    stored.save(str(tokenizer_dir / "tokenizer.json"))
    hf = HfChatTokenizer.from_dir(tokenizer_dir)
    for turns in (1, 3):
        msgs = conversation(turns)[:-1]
        got = await hf.chat_tokens(msgs)
        assert got == plain.encode(hf.render(msgs, add_generation_prompt=True), add_special_tokens=False).ids
        assert len(got) > 12 and 0 not in got  # neither cut to 8 nor padded
    short = await hf.chat_tokens([{"role": "user", "content": "hello"}])
    assert 0 not in short and len(short) < 12  # not padded to 12


def test_hf_tokenizer_dir_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"tokenizer\.json"):
        HfChatTokenizer.from_dir(tmp_path)


async def test_sim_tokenizer_prefix_cache_equals_full_render() -> None:
    sim = SimChatTokenizer()
    msgs: list[dict[str, str]] = [{"role": "system", "content": "be brief"}]
    for turn in range(1, 5):
        # Long turns (6,000 characters) go to a thread; the history is reused from the cache.
        msgs.append({"role": "user", "content": sim_tokenizer.filler_text(2000, seed=turn)})
        assert await sim.chat_tokens(msgs) == sim_tokenizer.encode_chat(msgs, add_generation_prompt=True)
        msgs.append({"role": "assistant", "content": "ok"})
    assert sim.cache_stats()["hits"] == 3


def test_prefix_hashes_distinguish_content_and_order() -> None:
    a = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]
    b = [{"content": "x", "role": "user"}, {"role": "assistant", "content": "z"}]
    ha, hb = prefix_hashes(a), prefix_hashes(b)
    assert ha[0] == hb[0] and ha[1] != hb[1]


async def test_engine_tokenize_backend_against_real_server() -> None:
    calls: list[dict] = []

    async def tokenize(request: web.Request) -> web.Response:
        body = await request.json()
        calls.append(body)
        tokens = sim_tokenizer.encode_chat(
            body["messages"], add_generation_prompt=body["add_generation_prompt"]
        )
        return web.json_response(
            {"count": len(tokens), "max_model_len": 8192, "tokens": tokens, "token_strs": None}
        )

    app = web.Application()
    app.router.add_post("/tokenize", tokenize)
    runner = web.AppRunner(app)
    await runner.setup()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        async with aiohttp.ClientSession() as session:
            engine = EngineChatTokenizer(session, f"http://127.0.0.1:{port}", model="m")
            msgs = conversation(2)
            want = sim_tokenizer.encode_chat(msgs, add_generation_prompt=True)
            first = await engine.chat_tokens(msgs)
            assert first == want
            assert await engine.chat_tokens(msgs) is first  # exact repeat: cached, the same list
            assert len(calls) == 1 and calls[0]["model"] == "m" and calls[0]["add_generation_prompt"] is True
            bad = EngineChatTokenizer(session, f"http://127.0.0.1:{port}/nope")
            with pytest.raises(ValueError, match="404"):
                await bad.chat_tokens(msgs)
    finally:
        await runner.cleanup()


def test_sim_encode_text_matches_the_per_chunk_definition() -> None:
    """encode_text's C-speed path against the definition in sim_tokenizer's docstring: every 3-byte
    UTF-8 chunk is one token, 1000 + (n-1) x 2^24 + int(chunk, big-endian), a 1-2 byte tail last."""
    import random

    def reference(text: str) -> list[int]:
        data = text.encode("utf-8")
        return [
            1000 + (len(data[i : i + 3]) - 1) * 2**24 + int.from_bytes(data[i : i + 3], "big")
            for i in range(0, len(data), 3)
        ]

    rng = random.Random(5)
    alphabet = "ab z\n\t\u00e9\u4e2d\U0001f600\x00\x7f\uffff"
    for n in [0, 1, 2, 3, 4, 5, 6, 7, 100, 3001]:
        text = "".join(rng.choice(alphabet) for _ in range(n))
        assert sim_tokenizer.encode_text(text) == reference(text), repr(text[:40])
        assert sim_tokenizer.decode(sim_tokenizer.encode_text(text)) == text


async def test_sim_tokenizer_reuses_a_growing_message_by_its_cuts_and_stays_exact() -> None:
    """One user message that grows, is edited in the middle, and holds multi-byte characters
    across the 3,072-byte cuts: every prompt's tokens equal a full render."""
    sim = SimChatTokenizer()
    text = ("ünïcödé " * 500) + "😀" * 700  # 2- and 4-byte characters straddle the cuts
    versions = [text, text + "more " * 900, text[:4000] + "EDIT" + text[4004:] + "more " * 900, text + "x"]
    for i, content in enumerate(versions):
        msgs = [{"role": "system", "content": "s"}, {"role": "user", "content": content}]
        assert await sim.chat_tokens(msgs) == sim_tokenizer.encode_chat(msgs), i
    stats = sim.cache_stats()
    # Versions 1 and 3 extend version 0. Only each prompt's deepest cut is filed, so the edit
    # (before version 1's deepest cut) is a miss, encoded whole.
    assert stats["cut_hits"] == 2 and stats["cut_misses"] == 2  # versions 0 and 2


def test_cut_names_are_the_prefix_hashes_in_any_order_they_are_asked() -> None:
    """``CutNames`` names cut k by the xxh3 of the content's first (k + 1) cuts: asked alone (one
    call), walked down from the deepest (one by one, then every cut in one streaming pass) or up
    from the first, every name is that hash. Catches a streaming pass that skips or repeats a cut,
    a one-by-one hash of the wrong length, a negative index taken from the wrong end."""
    text = ('line one\n"quoted" \\ é 中 😀 ' * 900) + "tail"  # escapes' characters, 2-4 byte UTF-8
    message = {"role": "user", "content": text}
    data = text.encode()
    seed = xxhash.xxh3_64_intdigest(b"user", 0)  # a first message: nothing before it
    truth = [
        xxhash.xxh3_64_intdigest(data[: (k + 1) * CUT_BYTES], seed) for k in range(len(data) // CUT_BYTES)
    ]
    assert len(truth) > 2 * CutNames._WALK
    for k in range(-len(truth), len(truth)):  # asked alone
        cuts, got = content_cuts(0, message)
        assert got == data and cuts[k] == truth[k], k
    down, _ = content_cuts(0, message)
    assert [down[k] for k in reversed(range(len(truth)))] == truth[::-1]
    up, _ = content_cuts(0, message)
    assert list(up) == truth and up[2:5] == truth[2:5]
    # A repeated prompt's names: the deepest cut is hashed, no other.
    names = PromptNames.of([message])
    assert names.file_under == [names.prefixes[-1], truth[-1]]
    assert isinstance(names.cuts, CutNames) and names.cuts._names.count(None) == len(truth) - 1
    assert list(reversed(names.anchors)) == [names.prefixes[-1], *truth[::-1]]
    # Too short to cut: no names, and the whole prompt is its only anchor.
    short = PromptNames.of([{"role": "user", "content": "hi"}])
    assert not short.cuts and short.file_under == list(short.anchors) == short.prefixes
