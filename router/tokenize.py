"""Prompt token ids for a chat request: local HF tokenizer + jinja chat template, the engine's
``/tokenize``, or the simulator's tokenizer. Results are cached per conversation prefix so a long
history is not re-tokenised every turn; heavy work runs in a thread, never on the event loop. The
caches are bounded by their estimated size in bytes (one huge prompt must not pin gigabytes).
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple, Protocol, overload

import msgspec
import xxhash

from kvcore import sim_tokenizer

Messages = Sequence[Mapping[str, Any]]
_encode_msg = msgspec.msgpack.Encoder(order="deterministic").encode
_xxh3 = xxhash.xxh3_64_intdigest

#: Below this many new characters tokenisation is cheaper than a thread hop.
_INLINE_CHARS = 4096
#: Default bound of one tokenizer's prefix cache (config: tokenizer.cache_max_bytes).
DEFAULT_CACHE_BYTES = 64 * 1024 * 1024
#: Bytes a cached token id costs: a list slot (8) plus the int object (28; ids above 256 are not
#: shared by CPython).
_TOKEN_BYTES = 36
_ENTRY_OVERHEAD_BYTES = 200  # dict slot, key int, tuple/list headers


def prefix_hashes(messages: Messages, known: Sequence[int] = ()) -> list[int]:
    """Rolling hash of every message prefix: ``out[i]`` identifies ``messages[: i + 1]`` (each
    message's MessagePack hashed with the hash of the messages before it as the seed: no copy of
    a long message is made to chain it). ``known``: this function's hashes of the first
    ``len(known)`` messages, already computed (the conversation start's, for the session key):
    only the messages after them are encoded and hashed. OverflowError for an integer MessagePack
    cannot hold (beyond 64 bits)."""
    out = list(known)
    h = out[-1] if out else 0
    for msg in messages[len(out) :] if out else messages:
        h = _xxh3(_encode_msg(msg if type(msg) is dict else dict(msg)), h)
        out.append(h)
    return out


#: A message's content is also named by its cuts every this many UTF-8 bytes (1,024 simulator
#: tokens; a multiple of its 3-byte chunk), so a prompt whose last message extends an earlier
#: prompt's last message (one growing user message, as trace replays and some agent frameworks
#: send) finds the earlier prompt's tokens and keys.
CUT_BYTES = 3 * 1024


class CutNames(Sequence[int]):
    """The names of a message's content cuts, each hashed when first asked for: ``self[k]`` is the
    xxh3 of the content's first ``(k + 1) * CUT_BYTES`` UTF-8 bytes, seeded with the hash of the
    messages before it and its role. A repeated prompt asks for its deepest cut only: one call,
    where naming every cut took one per cut. A lookup walking down from the deepest cut (a message
    that grew since its last prompt) hashes the few cuts it reaches one by one, and every cut in
    one streaming pass once it has gone ``_WALK`` deep (XXH3's streaming digest of a prefix is its
    one-shot hash), so no content is hashed more than ``_WALK + 1`` times. The names live only in
    this process's caches (the tokenizer's and the key cache's)."""

    __slots__ = ("_asked", "_names", "_seed", "_view")

    #: Cuts hashed one by one before the rest are hashed in one pass.
    _WALK = 4

    def __init__(self, seed: int, data: bytes) -> None:
        self._seed = seed
        self._view = memoryview(data)  # cuts are hashed in place, not copied out
        self._names: list[int | None] = [None] * (len(data) // CUT_BYTES)
        self._asked = 0  # cuts hashed one by one

    def __len__(self) -> int:
        return len(self._names)

    @overload
    def __getitem__(self, k: int) -> int: ...

    @overload
    def __getitem__(self, k: slice) -> list[int]: ...

    def __getitem__(self, k: int | slice) -> int | list[int]:
        names = self._names
        if isinstance(k, slice):
            return [self[i] for i in range(*k.indices(len(names)))]
        name = names[k]  # (IndexError past either end, as a list's)
        if name is not None:
            return name
        if self._asked < self._WALK:
            self._asked += 1
            k %= len(names)
            name = names[k] = _xxh3(self._view[: (k + 1) * CUT_BYTES], self._seed)
            return name
        self._hash_all()
        name = names[k]
        assert name is not None
        return name

    def _hash_all(self) -> None:
        names, view = self._names, self._view
        state = xxhash.xxh3_64(seed=self._seed)
        for k in range(len(names)):
            state.update(view[k * CUT_BYTES : (k + 1) * CUT_BYTES])
            names[k] = state.intdigest()


#: A message too short to cut has no cut names (a tuple: as cheap to test as the list was).
_NO_CUTS: tuple[int, ...] = ()


def content_cuts(parent: int, message: Mapping[str, Any]) -> tuple[Sequence[int], bytes]:
    """(the names of ``message``'s content cuts (``CutNames``): ``out[k]`` names the messages hashed
    into ``parent`` plus the role and the first ``(k + 1) * CUT_BYTES`` bytes of the content; full
    cuts only, none for a message shorter than two cuts; the content's UTF-8 bytes, or b"" for a
    message too short to cut, whose bytes nothing reads)."""
    if type(message) is not dict and not isinstance(message, Mapping):  # (the ABC check is slow)
        return _NO_CUTS, b""
    text = sim_tokenizer.message_text(message.get("content"))
    if len(text) < 2 * CUT_BYTES and text.isascii():  # short: one byte per character, no encoding
        return _NO_CUTS, b""
    data = text.encode("utf-8")
    if len(data) < 2 * CUT_BYTES:  # a short message: the message-prefix hash is enough
        return _NO_CUTS, b""
    return CutNames(_xxh3(str(message.get("role")).encode(), parent), data), data


class _Anchors(Sequence[int]):
    """``PromptNames.anchors``: the message prefixes but the last, the last message's cuts, the
    whole prompt; a cut's name is hashed only when a lookup reaches it."""

    __slots__ = ("_cuts", "_prefixes")

    def __init__(self, prefixes: list[int], cuts: Sequence[int]) -> None:
        self._prefixes, self._cuts = prefixes, cuts

    def __len__(self) -> int:
        return len(self._prefixes) + len(self._cuts)

    @overload
    def __getitem__(self, i: int) -> int: ...

    @overload
    def __getitem__(self, i: slice) -> list[int]: ...

    def __getitem__(self, i: int | slice) -> int | list[int]:
        n = len(self)
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(n))]
        if not -n <= i < n:
            raise IndexError("anchor index out of range")
        i %= n
        before = len(self._prefixes) - 1
        if i < before:
            return self._prefixes[i]
        if i == n - 1:
            return self._prefixes[-1]
        return self._cuts[i - before]


class PromptNames(NamedTuple):
    """What names a chat prompt in the conversation caches (the tokenizer's and the block keys'),
    computed once per request: every message prefix's hash, the last message's content cuts and
    its UTF-8 content (when it has cuts). A named tuple: built once per request, cheaply."""

    prefixes: list[int]
    cuts: Sequence[int]
    last_content: bytes

    @classmethod
    def of(cls, messages: Messages, known: Sequence[int] = ()) -> PromptNames:
        """The names of ``messages``; ``known``: ``prefix_hashes`` of its first messages, already
        computed (``prefix_hashes``' ``known``)."""
        # (A first turn's names are all known: the session key's.)
        prefixes = list(known) if len(known) == len(messages) else prefix_hashes(messages, known)
        if not prefixes:
            return cls(prefixes, _NO_CUTS, b"")
        cuts, data = content_cuts(prefixes[-2] if len(prefixes) > 1 else 0, messages[-1])
        return cls(prefixes, cuts, data)

    @property
    def anchors(self) -> Sequence[int]:
        """Lookup names, shortest first: every message prefix, with the last message's cuts before
        the whole prompt (a lookup walks them longest first and stops at the first one filed)."""
        return _Anchors(self.prefixes, self.cuts) if self.prefixes else []

    @property
    def file_under(self) -> list[int]:
        """The names to file the prompt under: the whole prompt and its last message's deepest cut."""
        return [*self.prefixes[-1:], self.cuts[-1]] if self.cuts else self.prefixes[-1:]


def entry_bytes(value: Any) -> int:
    """Estimated memory of a cache value: a token list, or (rendered text, token list)."""
    if isinstance(value, tuple):
        text, tokens = value
        return _ENTRY_OVERHEAD_BYTES + len(text) + _TOKEN_BYTES * len(tokens)
    return _ENTRY_OVERHEAD_BYTES + _TOKEN_BYTES * len(value)


class _Lru:
    """Least-recently-used map bounded by the summed ``entry_bytes`` of its values."""

    def __init__(self, max_bytes: int, size_of: Callable[[Any], int] = entry_bytes) -> None:
        self.max_bytes = max_bytes
        self._size_of = size_of
        self.data: OrderedDict[Any, tuple[Any, int]] = OrderedDict()
        self.size_bytes = 0
        self.hits = 0
        self.misses = 0

    def get(self, key: Any) -> Any:
        item = self.data.get(key)
        if item is None:
            return None
        self.data.move_to_end(key)
        return item[0]

    def put(self, key: Any, value: Any) -> None:
        size = self._size_of(value)
        if size > self.max_bytes:
            return  # larger than the whole cache: keeping it would evict everything else
        old = self.data.pop(key, None)
        if old is not None:
            self.size_bytes -= old[1]
        self.data[key] = (value, size)
        self.size_bytes += size
        while self.size_bytes > self.max_bytes:
            _, (_, evicted) = self.data.popitem(last=False)
            self.size_bytes -= evicted

    def stats(self) -> dict[str, int]:
        return {
            "entries": len(self.data),
            "bytes": self.size_bytes,
            "max_bytes": self.max_bytes,
            "hits": self.hits,
            "misses": self.misses,
        }


class ChatTokenizer(Protocol):
    """What the router needs: prompt token ids of a chat (generation prompt appended), in a list
    the caller may keep but must not change: a whole-prompt cache hit hands back the very list of
    the earlier call, so the router's key cache knows an unchanged prompt by identity instead of a
    token-by-token check. ``names``: the prompt's ``PromptNames`` when the caller has them already
    (else computed here)."""

    async def chat_tokens(
        self, messages: Messages, *, model: str = "", names: PromptNames | None = None
    ) -> list[int]: ...

    def cache_stats(self) -> dict[str, int]: ...


class SimChatTokenizer:
    """The simulator's tokenizer and template (prefix-stable: only new messages are encoded)."""

    def __init__(self, *, cache_max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        #: Message-prefix hash -> that prompt's tokens, generation prompt included (the list handed
        #: out: a repeat gets the same object; a next turn takes all but its last token).
        self._cache = _Lru(cache_max_bytes)
        #: Last-message cut hash -> (prompt tokens, how many of them the cut covers); sized by the
        #: whole list, which the entry keeps alive.
        self._cuts = _Lru(cache_max_bytes // 4, size_of=lambda entry: entry_bytes(entry[0]))

    async def chat_tokens(
        self, messages: Messages, *, model: str = "", names: PromptNames | None = None
    ) -> list[int]:
        names = names or PromptNames.of(messages)
        hashes = names.prefixes
        start, cached = 0, None
        for i in range(len(hashes) - 1, -1, -1):
            cached = self._cache.get(hashes[i])
            if cached is not None:
                start = i + 1
                break
        if start:
            self._cache.hits += 1
        else:
            self._cache.misses += 1
        cuts, data = names.cuts, names.last_content
        prompt = None
        if cached is not None and start == len(messages):
            prompt = cached  # the whole prompt was cached: the same list, nothing new to encode
        elif cuts:
            # The last message may extend an earlier prompt's last message (its cut hashes name the
            # messages before it too, so the cached tokens cover them).
            prompt = self._extend_cut(cuts, data)
        if prompt is None:
            new = list(messages[start:])
            new_chars = sum(len(str(m.get("content") or "")) for m in new)
            if new_chars > _INLINE_CHARS:
                body = await asyncio.to_thread(sim_tokenizer.encode_chat, new, add_generation_prompt=False)
            else:
                body = sim_tokenizer.encode_chat(new, add_generation_prompt=False)
            # The cached prompt's history (all but its generation prompt), then the new messages
            # without the BOS of their partial render.
            prompt = cached[:-1] if cached is not None else [sim_tokenizer.BOS]
            prompt += body[1:]
            prompt.append(sim_tokenizer.ROLE_TOKENS["assistant"])
        if messages and prompt is not cached:  # a whole-prompt hit is in the cache (and fresh) already
            self._cache.put(hashes[-1], prompt)
        if cuts:
            # The tokens up to the last message's deepest cut: all but the generation prompt, the
            # message's END and the content after the cut.
            tail_tokens = -(-(len(data) - len(cuts) * CUT_BYTES) // sim_tokenizer.CHUNK_BYTES)
            covered = len(prompt) - 2 - tail_tokens
            held = self._cuts.get(cuts[-1])  # most recent now, as a put would make it
            if held is None or held[0] is not prompt or held[1] != covered:  # else: filed already
                self._cuts.put(cuts[-1], (prompt, covered))
        return prompt

    def _extend_cut(self, cuts: Sequence[int], data: bytes) -> list[int] | None:
        """Prompt tokens (generation prompt included) when the last message (content ``data``, cut
        hashes ``cuts``) extends a cached prompt's last message: its tokens up to the deepest shared
        cut, then only the rest encoded. None when no cut is cached."""
        for k in range(len(cuts) - 1, -1, -1):
            found = self._cuts.get(cuts[k])
            if found is not None:
                self._cuts.hits += 1
                tokens, n = found
                tail = sim_tokenizer.encode_utf8(data[(k + 1) * CUT_BYTES :])
                return [*tokens[:n], *tail, sim_tokenizer.END, sim_tokenizer.ROLE_TOKENS["assistant"]]
        self._cuts.misses += 1
        return None

    def cache_stats(self) -> dict[str, int]:
        stats = self._cache.stats()
        stats["cut_hits"], stats["cut_misses"] = self._cuts.hits, self._cuts.misses
        return stats


def ignore_stored_truncation_and_padding(tokenizer: Any) -> None:
    """Clear the ``truncation`` and ``padding`` a tokenizer.json may store. ``tokenizers`` applies
    them on every ``encode``; transformers (so vLLM) turns both off unless a call asks for them,
    and vLLM renders chats without. Kept, a stored ``truncation: {max_length: 128}`` cut every
    prompt to 128 tokens: the router predicted 128 cached tokens where the engine had thousands."""
    if getattr(tokenizer, "truncation", None) is not None:
        tokenizer.no_truncation()
    if getattr(tokenizer, "padding", None) is not None:
        tokenizer.no_padding()


class HfChatTokenizer:
    """A local Hugging Face tokenizer directory: ``tokenizer.json`` + ``tokenizer_config.json``
    (its ``chat_template``, rendered with jinja2 in a sandbox).

    Prefix reuse: the history render (no generation prompt) of a cached message prefix is kept
    with its tokens; when the new render starts with it at a special-token boundary (where the
    tokenizer splits anyway), only the new text is encoded. Otherwise the whole text is encoded."""

    def __init__(
        self,
        tokenizer: Any,
        chat_template: str,
        *,
        bos_token: str = "",
        eos_token: str = "",
        cache_max_bytes: int = DEFAULT_CACHE_BYTES,
    ) -> None:
        import jinja2.sandbox

        env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:
            raise ValueError(f"chat template: {message}")

        env.globals["raise_exception"] = raise_exception
        self._template = env.from_string(chat_template)
        self._tokenizer = tokenizer
        self._specials = {"bos_token": bos_token, "eos_token": eos_token}
        added = tokenizer.get_added_tokens_decoder() if hasattr(tokenizer, "get_added_tokens_decoder") else {}
        self._boundary_tokens = tuple(t.content for t in added.values() if getattr(t, "special", False))
        self._cache = _Lru(cache_max_bytes)

    @classmethod
    def from_dir(cls, path: str | Path, **kwargs: Any) -> HfChatTokenizer:
        """Load from a local directory (blocking file I/O: call at startup or via to_thread)."""
        from tokenizers import Tokenizer

        directory = Path(path)
        tok_file, cfg_file = directory / "tokenizer.json", directory / "tokenizer_config.json"
        if not tok_file.is_file() or not cfg_file.is_file():
            raise ValueError(
                f"tokenizer directory {directory} needs tokenizer.json and tokenizer_config.json"
            )
        config = json.loads(cfg_file.read_text())
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if not isinstance(template, str):
            raise ValueError(
                f"{cfg_file} has no chat_template; set one or use the engine's /tokenize back-end"
            )

        def special(name: str) -> str:
            value = config.get(name) or ""
            return str(value.get("content", "")) if isinstance(value, dict) else str(value)

        tokenizer = Tokenizer.from_file(str(tok_file))
        ignore_stored_truncation_and_padding(tokenizer)
        return cls(
            tokenizer,
            template,
            bos_token=special("bos_token"),
            eos_token=special("eos_token"),
            **kwargs,
        )

    def render(self, messages: Messages, *, add_generation_prompt: bool) -> str:
        return self._template.render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **self._specials
        )

    def _encode(self, text: str) -> list[int]:
        return list(self._tokenizer.encode(text, add_special_tokens=False).ids) if text else []

    def _tokenize(
        self, messages: Messages, cached: tuple[str, list[int]] | None
    ) -> tuple[list[int], tuple[str, list[int]] | None]:
        full = self.render(messages, add_generation_prompt=True)
        history = self.render(messages, add_generation_prompt=False)
        if not (history and full.startswith(history) and history.endswith(self._boundary_tokens or ("\0",))):
            return self._encode(full), None
        if cached is not None and history.startswith(cached[0]) and cached[0].endswith(self._boundary_tokens):
            history_tokens = cached[1] + self._encode(history[len(cached[0]) :])
        else:
            history_tokens = self._encode(history)
        return history_tokens + self._encode(full[len(history) :]), (history, history_tokens)

    async def chat_tokens(
        self, messages: Messages, *, model: str = "", names: PromptNames | None = None
    ) -> list[int]:
        names = names or PromptNames.of(messages)
        hashes = names.prefixes
        cached = None
        for i in range(len(hashes) - 1, -1, -1):
            cached = self._cache.get(hashes[i])
            if cached is not None:
                break
        if cached is not None:
            self._cache.hits += 1
        else:
            self._cache.misses += 1
        tokens, entry = await asyncio.to_thread(self._tokenize, list(messages), cached)
        if entry is not None and hashes:
            self._cache.put(hashes[-1], entry)
        return tokens

    def cache_stats(self) -> dict[str, int]:
        return self._cache.stats()


class EngineChatTokenizer:
    """The engine's own ``POST /tokenize`` with ``messages`` (exactly its template).

    ``session`` is an aiohttp ClientSession owned by the caller. Only exact repeats are cached:
    the engine renders the whole conversation, so there is no prefix to reuse."""

    def __init__(
        self,
        session: Any,
        engine_url: str,
        *,
        model: str = "",
        cache_max_bytes: int = DEFAULT_CACHE_BYTES,
        timeout_s: float = 10.0,
    ) -> None:
        self._session = session
        self._url = engine_url.rstrip("/") + "/tokenize"
        self._model = model
        self._timeout_s = timeout_s
        self._cache = _Lru(cache_max_bytes)

    async def chat_tokens(
        self, messages: Messages, *, model: str = "", names: PromptNames | None = None
    ) -> list[int]:
        names = names or PromptNames.of(messages)
        hashes = names.prefixes
        key = hashes[-1] if hashes else 0
        cached = self._cache.get(key)
        if cached is not None:
            self._cache.hits += 1
            return cached  # the same list as the first time: the caller knows the prompt by identity
        self._cache.misses += 1
        import aiohttp

        body = {"model": model or self._model, "messages": list(messages), "add_generation_prompt": True}
        async with self._session.post(
            self._url, json=body, timeout=aiohttp.ClientTimeout(total=self._timeout_s)
        ) as resp:
            if resp.status != 200:
                text = await resp.text()
                raise ValueError(f"POST {self._url} answered {resp.status}: {text[:200]}")
            payload = await resp.json()
        tokens = payload.get("tokens")
        if not isinstance(tokens, list):
            raise ValueError(f"POST {self._url}: response has no 'tokens' list")
        self._cache.put(key, tokens)
        return tokens

    def cache_stats(self) -> dict[str, int]:
        return self._cache.stats()
