"""The errors the server answers with: OpenAI's error object, with llama-server's types and codes.

    {"error": {"code": 400, "message": "...", "type": "invalid_request_error"}}

Every refusal is one of these, with one line of message naming the field or limit and what was
expected; nothing a client sends turns into a traceback.
"""
from __future__ import annotations

from typing import Any

# llama-server's error types (server-common.h), by HTTP status.
INVALID_REQUEST = "invalid_request_error"  # 400
AUTHENTICATION = "authentication_error"  # 401
NOT_FOUND = "not_found_error"  # 404
TOO_LARGE = "request_too_large_error"  # 413 (llama-server has no name for it)
SERVER = "server_error"  # 500
NOT_SUPPORTED = "not_supported_error"  # 501
UNAVAILABLE = "unavailable_error"  # 503
EXCEED_CONTEXT = "exceed_context_size_error"  # 400, llama-server's name for a prompt over the slot's context


class ApiError(Exception):
    """A request the server refuses: the HTTP status, OpenAI's error type and one line saying why."""

    def __init__(self, status: int, kind: str, message: str, *, headers: dict[str, str] | None = None,
                 **extra: Any) -> None:
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message
        self.headers = headers or {}
        self.extra = extra  # more fields of the error object (n_prompt_tokens, n_ctx)

    def body(self) -> dict:
        return {"error": {"code": self.status, "message": self.message, "type": self.kind, **self.extra}}


def bad_request(message: str) -> ApiError:
    return ApiError(400, INVALID_REQUEST, message)


def unavailable(message: str, retry_after: int | None = None) -> ApiError:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    return ApiError(503, UNAVAILABLE, message, headers=headers)


LOADING = "Loading model"  # llama-server's words while the model loads
SHUTTING_DOWN = "the server is shutting down"


# Anthropic's error types, by HTTP status (its Messages API answers in its own shape).
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                    413: "request_too_large", 500: "api_error", 503: "overloaded_error"}


def anthropic_error(error: ApiError) -> dict:
    """The error object of Anthropic's API: {"type": "error", "error": {"type", "message"}}."""
    return {"type": "error", "error": {"type": _ANTHROPIC_TYPES.get(error.status, "api_error"),
                                       "message": error.message}}
