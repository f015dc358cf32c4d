"""Graceful shutdown for `pagedlm serve`."""
from __future__ import annotations

import asyncio
import logging

import uvicorn

logger = logging.getLogger("pagedlm.server")


class GracefulServer(uvicorn.Server):
    """On SIGTERM (or SIGINT) uvicorn stops accepting connections; new requests on connections still open get
    503 (`front.draining`, /health too); running requests may finish for `timeout` seconds, then are ended with
    an error (a stream gets an error event and `[DONE]`) before the connections close."""

    def __init__(self, config: uvicorn.Config, front, timeout: float) -> None:
        super().__init__(config)
        self.front, self.timeout = front, timeout

    async def shutdown(self, sockets=None) -> None:
        self.front.begin_shutdown()
        logger.info("Shutting down: %d open requests get up to %g s to finish", self.front.num_open_requests,
                    self.timeout)
        ender = asyncio.ensure_future(self._end_open_requests())
        try:
            await super().shutdown(sockets)
        finally:
            ender.cancel()

    async def _end_open_requests(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        while self.front.num_open_requests and loop.time() < deadline:
            await asyncio.sleep(0.05)
        if self.front.num_open_requests:
            logger.warning("Ending the %d requests still open after %g s", self.front.num_open_requests, self.timeout)
            self.front.fail_open_requests("The server is shutting down; the request was ended.")
