"""OpenAI-shaped errors of the router: one exception type carrying status, message, type and code.

Raise ``RouterError`` anywhere on the request path; ``router.app`` turns it into
``{"error": {"message", "type", "code"}}`` with the status, and logs it with the request id.
Messages are clipped (``MAX_MESSAGE_CHARS``): client-supplied values quoted in them (a 10 MB model
name) must not be echoed whole into answers and logs.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import msgspec

_encode = msgspec.json.Encoder().encode

#: Longest error message sent or logged; longer ones keep their start and say how long they were.
MAX_MESSAGE_CHARS = 512


def clip(text: str, max_chars: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` cut to ``max_chars`` (plus a note of the original length) when longer."""
    if len(text) <= max_chars:
        return text
    return f"{text[:max_chars]}... ({len(text)} characters, clipped)"


class RouterError(Exception):
    """A request the router answers with an error instead of an engine's response."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        code: str = "",
        headers: dict[str, str] | None = None,
    ):
        message = clip(message)
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code or type
        #: Extra response headers (e.g. ``connection: close`` after an unread body).
        self.headers = headers

    def body(self) -> bytes:
        return error_body(self.message, type=self.type, code=self.code)


def error_body(message: str, *, type: str, code: str) -> bytes:
    """JSON bytes of an OpenAI-style error object."""
    return _encode({"error": {"message": message, "type": type, "code": code}})


def sse_error_event(message: str, *, type: str, code: str) -> bytes:
    """An OpenAI-style error as one SSE event (what vLLM sends when a stream fails midway)."""
    return b"data: " + error_body(message, type=type, code=code) + b"\n\n"


def bad_request(message: str, code: str = "invalid_request") -> RouterError:
    return RouterError(400, message, code=code)


class FieldRules:
    """Checks of optional body fields, run only for the fields a body has (most set one or two).

    ``rules`` are tuples starting with the field's name, in the order errors are reported;
    ``check(body, *rule)`` raises the field's ``bad_request``. The quick test of a present value,
    in C and without a call per field: its exact type is one of ``exact[name]`` (as JSON decodes
    it) and, for a field in ``ranges``, a value other than None lies in ``(lowest, highest)``.
    When a present field fails it, every rule is checked in order, so the error names the first
    bad field whatever order the body's keys came in."""

    __slots__ = ("_check", "_exact", "_names", "_ranges", "_rules")

    def __init__(
        self,
        rules: Sequence[tuple[Any, ...]],
        check: Callable[..., None],
        exact: Mapping[str, tuple[type, ...]],
        ranges: Mapping[str, tuple[float, float]] | None = None,
    ) -> None:
        self._rules = tuple(rules)
        self._names = frozenset(rule[0] for rule in self._rules)
        self._check = check
        self._exact = dict(exact)
        self._ranges = dict(ranges or {})

    def check(self, body: Mapping[str, Any]) -> None:
        exact, ranges = self._exact, self._ranges
        for name in self._names.intersection(body):
            value = body[name]
            if type(value) in exact[name]:
                if not ranges or value is None:
                    continue
                low, high = ranges[name]
                if low <= value <= high:
                    continue
            for rule in self._rules:
                if rule[0] in body:
                    self._check(body, *rule)
            return
