"""`APIError`, an error answered to a client, and each API's shape of it: the body its clients expect, chosen by
the request's path. OpenAI's (`{"error": {"message", "type", "param", "code"}}`) is the default; Ollama's routes
(/api/...) answer `{"error": "<message>"}` and Anthropic's (/v1/messages...) `{"type": "error", "error": {"type",
"message"}}`. The status code is the same in every shape."""
from __future__ import annotations


class APIError(Exception):
    """An error answered in OpenAI's shape: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


RETRY_AFTER_S = 1  # the Retry-After of 503s (queue full, no model available, shutting down)


class Unavailable(APIError):
    """The chosen model could not take or finish the request (queue full, failed, stopped) before anything
    reached the client; a routed request tries another model."""


def shutting_down() -> APIError:
    return APIError(503, "The server is shutting down.", type="server_error", code="shutting_down",
                    headers={"Retry-After": str(RETRY_AFTER_S)})


OLLAMA_PREFIX = "/api/"
ANTHROPIC_PREFIX = "/v1/messages"

# Anthropic's error types by status (its API reference, *Errors*)
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error",
                    503: "overloaded_error", 529: "overloaded_error"}


def anthropic_error(e: APIError) -> dict:
    kind = _ANTHROPIC_TYPES.get(e.status, "api_error" if e.status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": e.message}}


def ollama_error(e: APIError) -> dict:
    return {"error": e.message}


def error_body(e: APIError, path: str = "") -> dict:
    """`e` in the shape of the API that serves `path`."""
    if path.startswith(OLLAMA_PREFIX):
        return ollama_error(e)
    if path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/"):
        return anthropic_error(e)
    return e.body()
