"""Reading an OpenAI SSE answer back: its JSON chunks, for the layers that rewrite a stream (other APIs' events,
reasoning split out of the content)."""
from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

__all__ = ["StreamFailed", "chunks"]


class StreamFailed(Exception):
    """The engine failed a request after its stream began (the OpenAI stream's error event)."""

    def __init__(self, error: dict) -> None:
        super().__init__(error.get("message", "The request failed."))
        self.message = str(self)
        self.type = error.get("type") or "server_error"


async def chunks(inner: AsyncIterator[str | bytes]) -> AsyncIterator[dict[str, Any]]:
    """The JSON chunks of an OpenAI SSE answer's body (its `body_iterator`, taken before `restream` replaces
    it), until `[DONE]`; its error event raises StreamFailed. Closing this iterator closes the body (which aborts
    the answer's engine requests)."""
    buffer = ""
    try:
        async for piece in inner:
            buffer += piece if isinstance(piece, str) else piece.decode()
            while "\n\n" in buffer:
                block, buffer = buffer.split("\n\n", 1)
                data = "".join(line[5:].strip() for line in block.splitlines() if line.startswith("data:"))
                if not data:
                    continue
                if data == "[DONE]":
                    return
                obj = json.loads(data)
                if "error" in obj and "choices" not in obj:
                    raise StreamFailed(obj["error"] or {})
                yield obj
    finally:
        aclose = getattr(inner, "aclose", None)
        if aclose is not None:
            await aclose()
