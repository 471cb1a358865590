"""Request-body schemas of the router's POST endpoints for its OpenAPI document (/openapi.json).

The handlers read raw bytes (the body is forwarded unchanged), so FastAPI cannot infer these; they
describe what the router itself checks (router.routing.parse_request, router.app.validate_body),
and let schemathesis generate requests from the router's own schema (tests/test_app_fuzz.py).
"""

from __future__ import annotations

from typing import Any

_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_COMMON: dict[str, Any] = {
    "model": {"type": "string", "minLength": 1},
    "stream": {"type": "boolean"},
    "stream_options": {"type": "object"},
    "max_tokens": {"type": "integer", "minimum": 1},
    "n": {"type": "integer", "minimum": 1},
    "temperature": {"type": "number", "minimum": 0},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "user": {"type": "string"},
    "cache_salt": {"type": "string", "minLength": 1},
}
_CONTENT_PART = {
    "type": "object",
    "properties": {"type": {"type": "string"}, "text": {"type": "string"}},
    "required": ["type"],
}
_MESSAGE = {
    "type": "object",
    "properties": {
        "role": {"type": "string"},
        "content": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": _CONTENT_PART},
                {"type": "null"},
            ]
        },
    },
    "required": ["role"],
}
CHAT_BODY: dict[str, Any] = {
    "type": "object",
    "properties": {
        **_COMMON,
        "messages": {"type": "array", "items": _MESSAGE, "minItems": 1},
        "max_completion_tokens": {"type": "integer", "minimum": 1},
    },
    "required": ["model", "messages"],
}
COMPLETION_BODY: dict[str, Any] = {
    "type": "object",
    "properties": {
        **_COMMON,
        "prompt": {
            "anyOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}, "minItems": 1},
                _TOKEN_IDS,
                {"type": "array", "items": _TOKEN_IDS, "minItems": 1},
            ]
        },
    },
    "required": ["model", "prompt"],
}
EXPLAIN_BODY: dict[str, Any] = {"anyOf": [CHAT_BODY, COMPLETION_BODY]}

_ERROR = {
    "description": "OpenAI-shaped error",
    "content": {
        "application/json": {
            "schema": {
                "type": "object",
                "properties": {
                    "error": {
                        "type": "object",
                        "properties": {
                            "message": {"type": "string"},
                            "type": {"type": "string"},
                            "code": {"type": "string"},
                        },
                        "required": ["message", "type", "code"],
                    }
                },
                "required": ["error"],
            }
        }
    },
}


def operation(body_schema: dict[str, Any], *, streams: bool = False) -> dict[str, Any]:
    """``openapi_extra`` of a POST route taking ``body_schema`` as JSON."""
    ok: dict[str, Any] = {"application/json": {"schema": {"type": "object"}}}
    if streams:
        ok["text/event-stream"] = {"schema": {"type": "string"}}
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": body_schema}}},
        "responses": {
            "200": {"description": "the engine's answer (SSE when stream is true)", "content": ok},
            **{
                str(status): _ERROR for status in (400, 401, 403, 404, 408, 413, 415, 429, 499, 502, 503, 504)
            },
        },
    }


#: ``openapi_extra`` of the endpoints behind the guard's admin token or debug access
#: (router.guard.Authenticator): what they answer before the handler runs.
GUARDED_OPERATION: dict[str, Any] = {
    "responses": {
        "401": {**_ERROR, "description": "missing token (OpenAI-shaped error)"},
        "403": {**_ERROR, "description": "wrong token (OpenAI-shaped error)"},
        "404": {
            **_ERROR,
            "description": "endpoint disabled, or unknown engine / tenant (OpenAI-shaped error)",
        },
        "429": {**_ERROR, "description": "too many failed authentications (OpenAI-shaped error)"},
    }
}
