"""OpenAI-shaped errors of the router: one exception type carrying status, message, type and code.

Raise ``RouterError`` anywhere on the request path; ``router.app`` turns it into
``{"error": {"message", "type", "code"}}`` with the status, and logs it with the request id.
"""

from __future__ import annotations

import msgspec

_encode = msgspec.json.Encoder().encode


class RouterError(Exception):
    """A request the router answers with an error instead of an engine's response."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", code: str = ""):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.code = code or type

    def body(self) -> bytes:
        return error_body(self.message, type=self.type, code=self.code)


def error_body(message: str, *, type: str, code: str) -> bytes:
    """JSON bytes of an OpenAI-style error object."""
    return _encode({"error": {"message": message, "type": type, "code": code}})


def bad_request(message: str, code: str = "invalid_request") -> RouterError:
    return RouterError(400, message, code=code)
