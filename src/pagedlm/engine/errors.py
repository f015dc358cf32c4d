"""The errors a request stream raises (the server maps them to HTTP statuses)."""
from __future__ import annotations


class QueueFullError(RuntimeError):
    """The waiting queue already holds `max_waiting` requests; retry later (HTTP 503)."""


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served."""


class RequestFailedError(RuntimeError):
    """The engine failed while running this request, which was aborted (its blocks freed)."""


def stalled_error(request_id: str, stall_timeout: float) -> RequestFailedError:
    return RequestFailedError(f"Request {request_id} was aborted: its output was not read for {stall_timeout:g} s.")
