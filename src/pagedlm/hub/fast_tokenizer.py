"""A converted GGUF tokenizer restored without importing transformers (half a second of every start, and a fifth
more for `from_pretrained`): what the engine asks of a tokenizer for every request (encode, decode, the
detokenizer's token strings, the special ids) answered by the Rust tokenizer transformers wraps, as transformers
configured it, from a snapshot written beside the converted copy the first time transformers loads it.

The snapshot (`pagedlm_fast.json` + the Rust tokenizer's state in `pagedlm_backend.json`, in `<file>.tokenizer/`)
is taken only where the result cannot differ from the transformers tokenizer's: its class implements these
methods as `TokenizersBackend` does (none overridden), and the two agree on probe texts when it is taken; or
(`store_snapshot`) of a byte-level BPE vocabulary that gguf_vocab.py built as transformers converts it, at a first
start without transformers. It is used only if all of this holds, else ignored (transformers is loaded as before)
and taken again:
- its format, and the transformers and tokenizers versions, are the running ones;
- every other file of the directory (the converted tokenizer, its config and chat template, the stamp of the GGUF
  it was converted from) has the size and mtime it had when the snapshot was taken (a reconversion or an edited
  config is seen);
- the Rust tokenizer's state matches its SHA-256 (a damaged or partly written file is seen).
Anything else (chat templates, constraint compilation, the tokenize endpoints) goes to the transformers tokenizer,
loaded on first use (`Tokenizer.hf`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

SNAPSHOT = "pagedlm_fast.json"
BACKEND = "pagedlm_backend.json"
_FORMAT = 1
# TokenizersBackend's own implementations of what FastTokenizer reproduces: a class overriding any is not snapshot
_METHODS = ("encode", "_encode_plus", "decode", "_decode", "convert_ids_to_tokens", "convert_tokens_to_string",
            "set_truncation_and_padding", "clean_up_tokenization", "__len__", "_convert_token_to_id_with_added_voc")
_PROBES = ("Hello, world! It's 12:30 - isn't it?", "  two  spaces\nnew line\ttab ", "ünïcödé 日本語 🙂 ok", "")


@dataclass(frozen=True)
class TokenizerFacts:
    """The transformers tokenizer's attributes the engine reads."""

    eos_token_id: int | None
    bos_token_id: int | None
    unk_token_id: int | None
    all_special_ids: list[int]
    size: int  # len(tokenizer): the vocabulary with the added tokens
    chat_template: Any  # str, a dict of named templates, or None
    clean_up: bool  # decode applies clean_up_tokenization
    split_special_tokens: bool


class FastTokenizer:
    """Encode, decode and the detokenizer's calls, as the transformers tokenizer `facts` were read from answers
    them (see the module's docstring)."""

    def __init__(self, backend, facts: TokenizerFacts) -> None:
        backend.no_truncation()  # as transformers sets the backend before every encode without truncation
        backend.no_padding()
        backend.encode_special_tokens = facts.split_special_tokens
        self.backend, self.facts = backend, facts

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up(text) if self.facts.clean_up else text

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        to_token = self.backend.id_to_token
        return [to_token(int(i)) for i in ids]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        decoder = self.backend.decoder
        return decoder.decode(tokens) if decoder is not None else " ".join(tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.backend.token_to_id(token)


def load_snapshot(directory: Path) -> FastTokenizer | None:
    """The snapshot in `directory`, or None (absent, stale or damaged: see the module's docstring)."""
    try:
        meta = json.loads((directory / SNAPSHOT).read_text())
        if meta.get("format") != _FORMAT or meta.get("versions") != _versions() or meta.get("files") != _files(
                directory):
            return None
        data = (directory / BACKEND).read_bytes()
        if hashlib.sha256(data).hexdigest() != meta.get("backend_sha256"):
            logger.warning("Tokenizer snapshot in %s is damaged; transformers loads the tokenizer.", directory)
            return None
        from tokenizers import Tokenizer as RustTokenizer

        return FastTokenizer(RustTokenizer.from_str(data.decode()), TokenizerFacts(**meta["facts"]))
    except Exception as e:  # noqa: BLE001 - whatever the files hold: transformers loads the tokenizer instead
        if not isinstance(e, FileNotFoundError):
            logger.warning("Tokenizer snapshot in %s not used (%s: %s).", directory, type(e).__name__, e)
        return None


def save_snapshot(directory: Path, hf) -> bool:
    """Snapshot the transformers tokenizer `hf`, loaded from `directory`, into it where FastTokenizer answers as
    `hf` does (False where not: its class overrides a method, or the probes differ). Never raises."""
    try:
        from transformers import TokenizersBackend

        cls = type(hf)
        if not isinstance(hf, TokenizersBackend) or any(getattr(cls, m) is not getattr(TokenizersBackend, m)
                                                        for m in _METHODS):
            return False
        backend = hf.backend_tokenizer
        clean_up = bool(hf.clean_up_tokenization_spaces) and not (
            type(backend.model).__name__ == "BPE"
            and not hf.clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output)
        facts = TokenizerFacts(hf.eos_token_id, hf.bos_token_id, hf.unk_token_id, list(hf.all_special_ids), len(hf),
                               hf.chat_template, clean_up, bool(hf.split_special_tokens))
        # Over `hf`'s own Rust tokenizer (its state restores as saved: transformers' tokenizer.json is the same
        # serialization), whose settings FastTokenizer sets as transformers does before every encode.
        if not _agrees(FastTokenizer(backend, facts), hf):
            logger.info("Tokenizer of %s: no snapshot (it does not answer as transformers' does).", directory)
            return False
        return store_snapshot(directory, backend, facts)
    except Exception as e:  # noqa: BLE001 - a start without the snapshot is only slower
        logger.warning("Tokenizer snapshot not written in %s (%s: %s).", directory, type(e).__name__, e)
        return False


def store_snapshot(directory: Path, backend, facts: TokenizerFacts) -> bool:
    """Snapshot the Rust tokenizer `backend` and `facts` into `directory`, whose other files are complete (the
    caller knows they answer as the transformers tokenizer saved there: `save_snapshot`, or gguf_vocab.py's
    conversion). False where it could not be written."""
    try:
        data = backend.to_str().encode()
        _write(directory / BACKEND, data)
        meta = {"format": _FORMAT, "versions": _versions(), "files": _files(directory),
                "backend_sha256": hashlib.sha256(data).hexdigest(), "facts": asdict(facts)}
        _write(directory / SNAPSHOT, json.dumps(meta).encode())
        return True
    except OSError as e:
        logger.warning("Tokenizer snapshot not written in %s (%s: %s).", directory, type(e).__name__, e)
        return False


def _agrees(fast: FastTokenizer, hf) -> bool:
    ids = list(range(0, len(hf), max(1, len(hf) // 512))) + list(hf.all_special_ids)
    if fast.convert_ids_to_tokens(ids) != hf.convert_ids_to_tokens(ids):
        return False
    for text in _PROBES:
        for special in (True, False):
            enc = hf.encode(text, add_special_tokens=special)
            if fast.encode(text, add_special_tokens=special) != enc:
                return False
            for skip in (True, False):
                if fast.decode(enc + ids[:64], skip) != hf.decode(enc + ids[:64], skip_special_tokens=skip):
                    return False
        tokens = hf.convert_ids_to_tokens(enc)
        if fast.convert_tokens_to_string(tokens) != hf.convert_tokens_to_string(tokens):
            return False
    return True


def _clean_up(text: str) -> str:
    """transformers' `clean_up_tokenization`."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"), (" 'm", "'m"),
                 (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):
        text = text.replace(a, b)
    return text


def _versions() -> dict[str, str]:
    return {name: metadata.version(name) for name in ("transformers", "tokenizers")}


def _files(directory: Path) -> dict[str, list[int]]:
    """Size and mtime of every file of `directory` but the snapshot's own."""
    out = {}
    for entry in os.scandir(directory):
        if entry.name not in (SNAPSHOT, BACKEND) and entry.is_file(follow_symlinks=False):
            st = entry.stat(follow_symlinks=False)
            out[entry.name] = [st.st_size, st.st_mtime_ns]
    return dict(sorted(out.items()))


def _write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o666 & ~mask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
