"""The prompt's router block keys: the configured chat tokenizer (``build_tokenizer``) and the
annotator that turns a request's prompt into token ids, block keys (per engine block size, LoRA
and cache_salt; a conversation's earlier turns reused from ``KeyChainCache``) and index matches.
"""

from __future__ import annotations

import asyncio
import logging
import operator
import time
from collections.abc import Callable, Sequence
from typing import Any

import aiohttp
from prometheus_client.core import CounterMetricFamily

from kvcore import sim_tokenizer
from kvcore.index import PrefixIndex
from kvcore.keys import KeyChainCache, block_keys, request_extra_keys
from policies.base import engine_id_of
from router.config import ConfigError, RouterConfig
from router.load import LoadTracker
from router.routing import CHAT, RouteContext
from router.tokenize import EngineChatTokenizer, HfChatTokenizer, PromptNames, SimChatTokenizer

log = logging.getLogger("kvroute.annotate")

_block_size_of = operator.attrgetter("block_size")

#: Prompts longer than this are hashed into block keys in a worker thread, off the event loop.
_INLINE_KEY_TOKENS = 8192


# ----------------------------------------------------------------------------- tokenizers


class HealthyEngineTokenizer:
    """Backend "engine": the first healthy engine's POST /tokenize (one cached client per engine).

    The aiohttp session is set by ``RouterServices.start`` (router/background.py; it lives on the
    event loop)."""

    def __init__(self, tracker: LoadTracker, *, cache_max_bytes: int) -> None:
        self._tracker = tracker
        self.cache_max_bytes = cache_max_bytes
        self.session: aiohttp.ClientSession | None = None
        self._clients: dict[str, EngineChatTokenizer] = {}

    async def chat_tokens(
        self, messages: Sequence[Any], *, model: str = "", names: PromptNames | None = None
    ) -> list[int]:
        if self.session is None:
            raise RuntimeError("engine tokenizer used before the router started")
        for state in self._tracker.engines.values():
            if state.healthy and self._tracker.serves(state, model):
                client = self._clients.get(state.config.id)
                if client is None:
                    client = self._clients[state.config.id] = EngineChatTokenizer(
                        self.session,
                        state.config.url,
                        model=state.config.model,
                        cache_max_bytes=self.cache_max_bytes // max(1, len(self._tracker.engines)),
                    )
                return await client.chat_tokens(messages, model=model, names=names)
        raise RuntimeError(f"no healthy engine serving {model!r} to tokenise with")

    def cache_stats(self) -> dict[str, int]:
        total = {"entries": 0, "bytes": 0, "max_bytes": 0, "hits": 0, "misses": 0}
        for client in self._clients.values():
            for key, value in client.cache_stats().items():
                total[key] = total.get(key, 0) + value
        return total


def build_tokenizer(config: RouterConfig, tracker: LoadTracker) -> Any:
    """The configured chat tokenizer, or None for backend "none"."""
    backend = config.tokenizer.backend
    cache_max_bytes = config.tokenizer.cache_max_bytes
    if backend == "sim":
        return SimChatTokenizer(cache_max_bytes=cache_max_bytes)
    if backend == "hf":
        if not config.tokenizer.path:
            raise ConfigError('tokenizer.backend "hf" needs tokenizer.path (a tokenizer directory)')
        try:
            return HfChatTokenizer.from_dir(config.tokenizer.path, cache_max_bytes=cache_max_bytes)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"tokenizer.path {config.tokenizer.path!r}: {exc}") from None
    if backend == "engine":
        return HealthyEngineTokenizer(tracker, cache_max_bytes=cache_max_bytes)
    return None


# ----------------------------------------------------------------------------- annotation


class IndexAnnotator:
    """Prompt -> token ids -> router block keys (engine block size, cache_salt) -> index matches."""

    def __init__(
        self,
        config: RouterConfig,
        tokenizer: Any,
        index: PrefixIndex | None,
        *,
        namespace: int,
        lora_of: Callable[[str], str | None] | None = None,
    ) -> None:
        self._config = config
        self._lora_of = lora_of
        self._tokenizer = tokenizer
        self._index = index
        self._namespace = namespace
        self._sim = config.tokenizer.backend == "sim"
        self._default_block_size = config.engines[0].block_size if config.engines else 16
        self._key_cache = KeyChainCache(config.tokenizer.cache_max_bytes)
        self.failures = 0
        #: ``annotate`` may start outside an asyncio task (the callback path steps ``Router.decide``
        #: by hand and gives it a task only when it suspends): true unless the tokenizer is an
        #: engine's (aiohttp's timeouts need the current task).
        self.steps_outside_task = config.tokenizer.backend != "engine"

    def _completion_ids(self, body: dict[str, Any]) -> list[int] | None:
        """Token ids of a completion's ``prompt``: ids as sent, or a text prompt through the
        simulator's tokenizer; None for batches and text prompts without a completion tokenizer."""
        prompt = body.get("prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
            return list(prompt)  # token ids are used as sent
        if isinstance(prompt, str) and self._sim:
            return sim_tokenizer.encode_prompt(prompt)
        return None

    async def _keys(
        self,
        names: PromptNames | None,
        file_under: Sequence[int],
        scope: tuple[int, str | None, str | None],
        tokens: list[int],
        block_size: int,
        lora: str | None,
        salt: str | None,
    ) -> list[int]:
        """Block keys of ``tokens``: the blocks a cached turn of the same conversation already
        hashed are reused (verified token by token), only the rest are hashed (in a thread when
        they are many); filed in the key cache."""
        key_cache = self._key_cache
        lookup = names.anchors if names is not None else ()
        reused, extended = key_cache.reusable(lookup, scope, tokens, block_size)
        start = len(reused)
        new: list[int] = []
        if len(tokens) - start * block_size >= block_size:  # a full block is left to hash
            extra = request_extra_keys(len(tokens) // block_size, lora_name=lora, cache_salt=salt)
            parent = reused[-1] if reused else self._namespace
            rest = tokens[start * block_size :] if start else tokens
            rest_extra = extra[start:] if extra is not None and start else extra
            if len(rest) > _INLINE_KEY_TOKENS:  # hashing a long prompt would stall every request
                new = await asyncio.to_thread(
                    block_keys, rest, block_size, parent=parent, extra_keys=rest_extra
                )
            else:
                new = block_keys(rest, block_size, parent=parent, extra_keys=rest_extra)
        # A prompt whose blocks are all reused gets the cache's own list back (nobody changes
        # it): no 1,000-key copy is made.
        keys = reused + new if reused and new else reused or new
        key_cache.put(file_under, scope, tokens, keys, reused_blocks=start, replaces=extended)
        return keys

    def key_cache_stats(self) -> dict[str, int]:
        return self._key_cache.stats()

    def collect(self) -> list[Any]:
        """``kvroute_prompt_blocks_total{source}``: prompt blocks whose keys the conversation cache
        gave (reused) or that were hashed; a low reused share on multi-turn traffic means the
        cache is too small or the chat template is not prefix-stable."""
        stats = self._key_cache.stats()
        family = CounterMetricFamily(
            "kvroute_prompt_blocks", "Prompt blocks keyed, by where the key came from", labels=["source"]
        )
        family.add_metric(["reused"], stats["reused_blocks"])
        family.add_metric(["hashed"], stats["hashed_blocks"])
        return [family]

    async def annotate(self, ctx: RouteContext) -> None:
        request = ctx.route_request
        chat = ctx.endpoint == CHAT
        if chat and self._tokenizer is None:
            return  # no chat tokenizer: nothing to key (and no prompt names to build for it)
        names: PromptNames | None = None
        try:
            if chat:
                # A chat prompt is named by its message prefixes (and its last message's content
                # cuts), once for the tokenizer and the key cache, so the next turn finds this one's
                # work. The list is kept by reference (key cache) and never changed: a repeat may
                # get it back.
                messages = ctx.body["messages"]
                names = PromptNames.of(messages, ctx.start_prefixes)
                tokens = await self._tokenizer.chat_tokens(messages, model=request.model, names=names)
            else:
                tokens = self._completion_ids(ctx.body)
        except Exception as exc:  # routing goes on without keys; counted and logged
            self.failures += 1
            log.warning(
                "request %s: tokenising failed (%s); routing without prefix keys", ctx.request_id, exc
            )
            return
        if tokens is None:
            return
        ctx.prompt_token_ids = tokens
        engines = ctx.fleet.engines if ctx.fleet is not None else ()
        # Keys per block size: an engine's events are keyed in its own (reported) block size.
        # (A fleet of one block size, the usual one, is grouped in C.)
        sizes = set(map(_block_size_of, engines))
        if len(sizes) == 1:
            by_size: dict[int, list[str]] = {sizes.pop(): list(map(engine_id_of, engines))}
        else:
            by_size = {}
            for view in engines:
                by_size.setdefault(view.block_size, []).append(view.engine_id)
            if not by_size:
                by_size[self._default_block_size] = []
        salt = ctx.body.get("cache_salt")
        salt = salt if isinstance(salt, str) else None
        lora = self._lora_of(request.model) if self._lora_of is not None else None
        request.prompt_tokens = len(tokens)
        file_under = names.file_under if names is not None else ()
        key_cache, index = self._key_cache, self._index
        matches: dict[str, Any] | None = None
        for block_size, engine_ids in by_size.items():
            scope = (block_size, lora, salt)
            # A prompt sent again (the tokenizer's very list, filed under its names) has its keys.
            keys = key_cache.refiled(file_under, scope, tokens, block_size)
            if keys is None:
                keys = await self._keys(names, file_under, scope, tokens, block_size, lora, salt)
            if matches is None:  # speculation, trace and pricing use the first group's chain
                request.block_size = block_size
                request.block_keys = keys
                matches = {}
            if index is not None and keys:
                found = index.match(keys, engine_ids, now=time.monotonic())
                if matches:
                    matches.update(found)
                else:
                    matches = found  # a new dict of the index's, this request's own
        if index is not None:
            request.prefix_matches = matches if matches is not None else {}
