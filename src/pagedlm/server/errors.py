"""Engine errors as OpenAI errors: one table from each `EngineError` code (engine/errors.py) to the HTTP status,
the error's `type` and `code`, and whether another model may take the request instead (`Unavailable`)."""
from __future__ import annotations

from dataclasses import dataclass

from pagedlm.engine.errors import EngineError
from pagedlm.server.protocol import RETRY_AFTER_S, APIError, Unavailable


@dataclass(frozen=True)
class HTTPError:
    status: int
    type: str = "invalid_request_error"
    code: str | None = None  # the body's `code`
    unavailable: bool = False  # raised as Unavailable: a routed request falls back to another model
    retry_after: bool = False


ERRORS: dict[str, HTTPError] = {
    "invalid_request": HTTPError(400),
    "context_length_exceeded": HTTPError(400, code="context_length_exceeded"),
    "admission": HTTPError(400),
    "chat_template": HTTPError(400),
    "queue_full": HTTPError(503, "server_error", "queue_full", unavailable=True, retry_after=True),
    "engine_dead": HTTPError(503, "server_error", unavailable=True),
    "request_failed": HTTPError(500, "server_error", unavailable=True),
    "constraint_failed": HTTPError(400, code="constraint_failed"),
}
_DEFAULT = HTTPError(500, "server_error", unavailable=True)


def api_error(e: EngineError, param: str | None = None) -> APIError:
    """The OpenAI error of `e` (`param` replaces the engine's where the request named the field otherwise)."""
    h = ERRORS.get(e.code, _DEFAULT)
    cls = Unavailable if h.unavailable else APIError
    return cls(h.status, e.message, type=h.type, param=param or e.param, code=h.code,
               headers={"Retry-After": str(RETRY_AFTER_S)} if h.retry_after else None)
