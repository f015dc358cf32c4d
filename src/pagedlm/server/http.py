"""The HTTP layer under the app: uvicorn's settings for `pagedlm serve` and its h11 protocol with two bounds that
uvicorn lacks, a request read deadline and a per-connection connection limit (see `LimitedH11Protocol`)."""
from __future__ import annotations

import asyncio
import json
import logging
import resource
from typing import Any

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagedlm.server import DEFAULT_MAX_CONNECTIONS, DEFAULT_REQUEST_READ_TIMEOUT
from pagedlm.server.protocol import RETRY_AFTER_S, APIError
from pagedlm.server.wire import error_response

logger = logging.getLogger("pagedlm.server")

KEEP_ALIVE_S = 30  # an idle keep-alive connection is closed after this many seconds
OVER_LIMIT_READ_TIMEOUT = 5.0  # the read deadline of a connection beyond the limit (it only gets its 503)
SPARE_FILES = 256  # open files the server needs besides its connections (models, logs, Ray, the event loop)


class LimitedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a read deadline and a connection limit.

    Read deadline: a request (line, headers and body) must arrive whole within `read_timeout` seconds of its first
    byte (on a new connection, of the connection): otherwise it is answered 408 (`request_timeout`) if no response
    has started, and the connection is closed. uvicorn's keep-alive timer runs only between a response and the
    next request's first byte, so a client that stalls mid-request held its socket for ever. 0: no deadline.

    Connection limit: a connection opened while `max_connections` others are open is beyond the limit for its
    lifetime: its request is answered 503 (`too_many_connections`, Retry-After) and the connection closed, and its
    read deadline is at most OVER_LIMIT_READ_TIMEOUT. Connections within the limit are served whatever opens
    later (uvicorn's `limit_concurrency` compares every request with the current count, so silent sockets beyond
    the limit would turn the requests of admitted connections into 503s too). 0: no limit.
    """

    max_connections: int = DEFAULT_MAX_CONNECTIONS
    read_timeout: float = DEFAULT_REQUEST_READ_TIMEOUT

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.limit_concurrency = None  # replaced by the per-connection decision in connection_made
        self._read_deadline: asyncio.TimerHandle | None = None
        self._timeout = self.read_timeout

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.max_connections and len(self.connections) > self.max_connections:
            self.app = _too_many_connections
            self._timeout = min(self._timeout or OVER_LIMIT_READ_TIMEOUT, OVER_LIMIT_READ_TIMEOUT)
        self._track_read()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._track_read()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._track_read()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read()
        super().connection_lost(exc)

    def _track_read(self) -> None:
        """Arm the deadline while a request is arriving (not armed yet: it runs from the request's first byte),
        cancel it once the request is whole or between requests."""
        state = self.conn.their_state
        arriving = state is h11.SEND_BODY or (state is h11.IDLE and (
            self.cycle is None or bool(self.conn.trailing_data[0])))
        if not arriving or self.transport.is_closing():
            self._cancel_read()
        elif self._read_deadline is None and self._timeout:
            self._read_deadline = self.loop.call_later(self._timeout, self._read_timed_out)

    def _cancel_read(self) -> None:
        if self._read_deadline is not None:
            self._read_deadline.cancel()
            self._read_deadline = None

    def _read_timed_out(self) -> None:
        self._read_deadline = None
        if self.transport.is_closing():
            return
        fresh = self.conn.their_state is h11.IDLE or self.cycle is None
        if fresh or not self.cycle.response_started:
            error = APIError(408, f"The request did not arrive within {self._timeout:g} s.", code="request_timeout")
            body = json.dumps(error.body()).encode()
            self.transport.write(b"HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\n"
                                 b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(body), body))
        logger.debug("Closing a connection whose request did not arrive within %g s", self._timeout)
        self.transport.close()


async def _too_many_connections(scope: dict, receive: Any, send: Any) -> None:
    error = APIError(503, "The server has too many open connections; retry later.", type="server_error",
                     code="too_many_connections", headers={"Retry-After": str(RETRY_AFTER_S), "Connection": "close"})
    await error_response(error)(scope, receive, send)


def limited_protocol(max_connections: int, read_timeout: float) -> type[LimitedH11Protocol]:
    """A LimitedH11Protocol class with these bounds (uvicorn builds one protocol object per connection)."""
    return type("LimitedH11Protocol", (LimitedH11Protocol,),
                {"max_connections": max_connections, "read_timeout": read_timeout})


def uvicorn_config(app: Any, *, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                   request_read_timeout: float = DEFAULT_REQUEST_READ_TIMEOUT, access_log: bool = True,
                   shutdown_timeout: float = 30.0) -> uvicorn.Config:
    """uvicorn's Config for `app`: the h11 protocol with these bounds (see LimitedH11Protocol; 0 turns one off),
    keep-alive KEEP_ALIVE_S, `shutdown_timeout` + 5 s for a graceful shutdown, uvicorn's logging left to ours."""
    return uvicorn.Config(app, log_config=None, access_log=access_log, http=limited_protocol(
        max_connections, request_read_timeout), timeout_graceful_shutdown=shutdown_timeout + 5,
        timeout_keep_alive=KEEP_ALIVE_S)


def ensure_open_files(max_connections: int) -> None:
    """Raise the soft limit on open files to max_connections + SPARE_FILES where the hard limit allows (the
    common soft limit, 1024, is about the default connection limit); warn where it cannot."""
    need = max_connections + SPARE_FILES
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if not max_connections or soft == resource.RLIM_INFINITY or soft >= need:
        return
    target = need if hard == resource.RLIM_INFINITY else min(need, hard)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        target = soft
    if target < need:
        logger.warning("The open-file limit (%d) is below --max-connections %d + %d: raise `ulimit -n` or lower "
                       "--max-connections", target, max_connections, SPARE_FILES)
