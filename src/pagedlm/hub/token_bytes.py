"""The bytes each token stands for, as the tokenizer's decoder would write them: a token that holds part of a
character (a byte-level BPE piece of a CJK character or an emoji, a SentencePiece `<0xE6>` byte) decodes alone to
U+FFFD, but its bytes are exact, and joined in order they give the text back (OpenAI's and llama-server's logprob
`bytes`). Read from the `tokenizers` backend's decoder: ByteLevel (GPT-2's byte alphabet), ByteFallback (`<0xNN>`)
and Replace (SentencePiece's `▁` for a space); added tokens (`<|im_end|>`) are their text."""
from __future__ import annotations

import json
import re
from functools import cache
from typing import Any

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@cache
def byte_decoder() -> dict[str, int]:
    """GPT-2's map from the 256 printable characters of byte-level BPE back to the bytes they stand for."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, n = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b], n = chr(256 + n), n + 1
    return {c: b for b, c in chars.items()}


class TokenBytes:
    """`backend` (a `tokenizers.Tokenizer`): each id's bytes, read on demand."""

    def __init__(self, backend: Any) -> None:
        self.backend = backend
        self.added = {i: t.content for i, t in backend.get_added_tokens_decoder().items()}
        kinds, self.replace = set(), []
        stack = [json.loads(backend.decoder.__getstate__())] if backend.decoder is not None else []
        while stack:
            d = stack.pop()
            kinds.add(d.get("type"))
            stack.extend(d.get("decoders") or [])
            if d.get("type") == "Replace" and "String" in (d.get("pattern") or {}):
                self.replace.append((d["pattern"]["String"], d.get("content", "")))
        self.byte_level, self.byte_fallback = "ByteLevel" in kinds, "ByteFallback" in kinds

    def __call__(self, token_id: int) -> bytes:
        if token_id in self.added:
            return self.added[token_id].encode()
        piece = self.backend.id_to_token(int(token_id))
        if piece is None:
            return b""
        if self.byte_level:
            table = byte_decoder()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
        if self.byte_fallback and (m := _BYTE_PIECE.fullmatch(piece)):
            return bytes([int(m.group(1), 16)])
        for pattern, content in self.replace:
            piece = piece.replace(pattern, content)
        return piece.encode()
