"""Every error an engine gives a request, in one place: one class per kind, each with a stable `code` and the request
field it concerns (`param`). They travel as themselves in process and as a `WireError` over Ray (`to_wire` /
`WireError.error`); the server maps codes to HTTP errors in one table (server/errors.py).

`InvalidRequestError` and its subclasses are ValueErrors (bad input: nothing was queued); the others are
RuntimeErrors (the engine could not take or finish the request).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar


class EngineError(Exception):
    """An error of one request. `code`: its kind (the key of the server's table); `param`: the request field to
    blame, or None."""

    code: ClassVar[str] = "engine_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.param = message, param

    def __reduce__(self):  # pickled (Ray) with its param
        return type(self), (self.message, self.param)

    def to_wire(self) -> WireError:
        return WireError(self.code, self.message, self.param)


class InvalidRequestError(EngineError, ValueError):
    """The request is invalid for this engine (limits, vocabulary, constraint, prompt)."""

    code = "invalid_request"


class ContextLengthError(InvalidRequestError):
    """The prompt leaves no room for a generated token in the context."""

    code = "context_length_exceeded"


class AdmissionError(InvalidRequestError):
    """The engine could never finish the request, even running alone (admission.py)."""

    code = "admission"


class ChatTemplateError(InvalidRequestError):
    """The model has no chat template, or its template rejected the messages."""

    code = "chat_template"

    def __init__(self, message: str, param: str | None = "messages") -> None:
        super().__init__(message, param)


class QueueFullError(EngineError, RuntimeError):
    """The waiting queue already holds `max_waiting` requests; retry later."""

    code = "queue_full"


class EngineDeadError(EngineError, RuntimeError):
    """The engine loop has stopped (or the replica was lost); no request can be served there."""

    code = "engine_dead"


class RequestFailedError(EngineError, RuntimeError):
    """The engine failed while running this request, which was aborted (its blocks freed)."""

    code = "request_failed"


class ConstraintError(EngineError, RuntimeError):
    """The request's output constraint stopped while it ran (a limit of the grammar engine that compiling it did not
    reach): the client's input, found late; the request was aborted (its blocks freed)."""

    code = "constraint_failed"

    def __init__(self, message: str, param: str | None = "structured_outputs") -> None:
        super().__init__(message, param)


_BY_CODE: dict[str, type[EngineError]] = {cls.code: cls for cls in (
    InvalidRequestError, ContextLengthError, AdmissionError, ChatTemplateError, QueueFullError, EngineDeadError,
    RequestFailedError, ConstraintError)}


@dataclass(frozen=True)
class WireError:
    """An EngineError as data (what a replica sends back)."""

    code: str
    message: str
    param: str | None = None

    def error(self) -> EngineError:
        """The error it stands for (an unknown code is a RequestFailedError)."""
        return _BY_CODE.get(self.code, RequestFailedError)(self.message, self.param)


def as_engine_error(e: BaseException, request_id: str) -> EngineError:
    """`e` as an EngineError: itself, an InvalidRequestError for any other ValueError (bad input), else a
    RequestFailedError naming only the class and the request (the details stay in the server log)."""
    if isinstance(e, EngineError):
        return e
    if isinstance(e, ValueError):
        return InvalidRequestError(str(e), getattr(e, "param", None))
    return failed(request_id, e)


def failed(request_id: str, error: BaseException) -> RequestFailedError:
    """The client-facing failure of a request the engine failed while running it: only the error's class is named
    (the details stay in the server log)."""
    return RequestFailedError(f"The engine failed ({type(error).__name__}) while running request {request_id}; "
                              "see the server log.")


def stalled_error(request_id: str, stall_timeout: float) -> RequestFailedError:
    return RequestFailedError(f"Request {request_id} was aborted: its output was not read for {stall_timeout:g} s.")
