"""Tokenizer: a thin wrapper over a Hugging Face fast tokenizer, loaded from an HF dir or a GGUF file."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedlm.hub.fast_tokenizer import FastTokenizer, load_snapshot, save_snapshot, store_snapshot
from pagedlm.hub.gguf_vocab import GGUFVocab
from pagedlm.hub.gguf_vocab import build as build_vocab
from pagedlm.hub.hf_config import load_hf_config
from pagedlm.hub.registry import open_gguf
from pagedlm.hub.token_bytes import TokenBytes

if TYPE_CHECKING:  # transformers is imported when a tokenizer is loaded (a second of start-up), not with pagedlm
    from transformers import PreTrainedTokenizerBase

__all__ = ["GEMMA_CHAT_TEMPLATE", "Tokenizer", "load_tokenizer"]

logger = logging.getLogger(__name__)

# Gemma's turn format, for Gemma checkpoints that ship no template (the pretrained base models).
GEMMA_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- set role = 'model' if message['role'] == 'assistant' else message['role'] -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)


def _ids(value: int | Iterable[int] | None) -> set[int]:
    if value is None:
        return set()
    return {int(value)} if isinstance(value, int) else {int(v) for v in value}


class Tokenizer:
    """Token ids are exactly those of the wrapped HF tokenizer `hf`. With `fast` (a GGUF's snapshot,
    fast_tokenizer.py), encoding, decoding and the detokenizer's calls go to it, and `hf` is loaded by `load_hf` on
    first use (chat templates, constraints, the tokenize endpoints): transformers is then not imported at start-up."""

    def __init__(self, hf: PreTrainedTokenizerBase | None = None, eos_token_ids: Iterable[int] = (),
                 fast: FastTokenizer | None = None, load_hf: Callable[[], PreTrainedTokenizerBase] | None = None,
                 default_chat_template: str | None = None) -> None:
        if hf is None and (fast is None or load_hf is None):
            raise ValueError("a Tokenizer needs a transformers tokenizer, or a snapshot and a way to load one")
        self._hf, self._fast, self._load_hf = hf, fast, load_hf
        self._lock = threading.Lock()
        self._token_bytes: Callable[[int], bytes] | None = None
        self._default_chat_template = default_chat_template
        if hf is not None and default_chat_template is not None:
            hf.chat_template = hf.chat_template or default_chat_template
        facts = fast.facts if fast is not None else hf
        self.eos_token_ids: set[int] = _ids(eos_token_ids) | _ids(facts.eos_token_id)
        self.bos_token_id: int | None = facts.bos_token_id
        self.vocab_size: int = fast.facts.size if fast is not None else len(hf)

    @property
    def hf(self) -> PreTrainedTokenizerBase:
        """The transformers tokenizer (loaded on first use where the engine started from a snapshot)."""
        if self._hf is None:
            with self._lock:
                if self._hf is None:
                    hf = self._load_hf()
                    if self._default_chat_template is not None:
                        hf.chat_template = hf.chat_template or self._default_chat_template
                    self._hf = hf
        return self._hf

    @property
    def chat_template(self) -> Any:
        if self._hf is not None or self._fast is None:
            return self.hf.chat_template
        return self._fast.facts.chat_template or self._default_chat_template

    @property
    def all_special_ids(self) -> list[int]:
        return list(self._fast.facts.all_special_ids) if self._fast is not None else self.hf.all_special_ids

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str | None]:
        """The token strings of `ids` (None for an id outside the vocabulary): the detokenizer's calls."""
        return self._fast.convert_ids_to_tokens(ids) if self._fast is not None else self.hf.convert_ids_to_tokens(ids)

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return (self._fast.convert_tokens_to_string(tokens) if self._fast is not None
                else self.hf.convert_tokens_to_string(tokens))

    def token_to_id(self, token: str) -> int | None:
        """The id of `token`, None where it is not in the vocabulary (or is the unknown token)."""
        if self._fast is not None:
            i, unk = self._fast.token_to_id(token), self._fast.facts.unk_token_id
        else:
            i, unk = self.hf.convert_tokens_to_ids(token), self.hf.unk_token_id
        return i if isinstance(i, int) and i != unk else None

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._fast is not None:
            return self._fast.encode(text, add_special_tokens)
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._fast is not None:
            return self._fast.decode(list(ids), skip_special_tokens)
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        """Each of `batch` decoded on its own, in one call to the Rust tokenizer where there is one (for display:
        no clean-up of tokenization spaces)."""
        batch = [list(ids) for ids in batch]
        backend = self._fast.backend if self._fast is not None else getattr(self.hf, "backend_tokenizer", None)
        if backend is not None:
            return backend.decode_batch(batch, skip_special_tokens=skip_special_tokens)
        return self.hf.batch_decode(batch, skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes `token_id` stands for (part of a character's, where it holds one: token_bytes.py)."""
        if self._token_bytes is None:
            backend = self._fast.backend if self._fast is not None else getattr(self.hf, "backend_tokenizer", None)
            self._token_bytes = (TokenBytes(backend) if backend is not None
                                 else lambda t: self.decode([t], skip_special_tokens=False).encode())
        return self._token_bytes(token_id)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, chat_template: str | None = None,
                            continue_final_message: bool = False, **template_vars: Any) -> str:
        """Render `messages` ([{"role": ..., "content": ...}]) to a prompt string (not tokenized); `tools`
        (OpenAI's function definitions) are the template's `tools` variable; `chat_template` replaces the
        tokenizer's own for this call; `continue_final_message`: the text ends with the last message's (transformers
        cuts what the template writes after it); `template_vars` are more variables of the template."""
        if tools:
            template_vars["tools"] = tools
        if continue_final_message:
            template_vars["continue_final_message"] = True
        if chat_template is not None:
            return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                               chat_template=chat_template, **template_vars)
        if not self.has_chat_template:
            raise ValueError(
                f"this model's tokenizer ({self.hf.name_or_path}) has no chat template; "
                "send a plain text prompt instead of chat messages"
            )
        return self.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt,
                                           **template_vars)


def load_tokenizer(path: Path) -> Tokenizer:
    """Tokenizer for a model path from `registry.resolve_model`.

    For a GGUF file, the vocabulary converted by transformers (a byte-level BPE one built as transformers converts
    it, without importing it: gguf_vocab.py) is cached next to it in `<file>.tokenizer/` (written atomically, rebuilt
    if the GGUF changes), with a snapshot that later starts load without transformers (fast_tokenizer.py).
    """
    path = Path(path)
    cfg = load_hf_config(path)
    eos = _ids(cfg["eos_token_id"])
    gemma = str(cfg["model_type"]).startswith("gemma")
    template = GEMMA_CHAT_TEMPLATE if gemma else None
    if path.is_dir():
        gen = path / "generation_config.json"
        if gen.is_file():
            eos |= _ids(json.loads(gen.read_text()).get("eos_token_id"))
        from transformers import AutoTokenizer

        tok = Tokenizer(AutoTokenizer.from_pretrained(path), eos, default_chat_template=template)
    else:
        hf, fast, cached = _gguf_tokenizer(path, cfg["model_type"])
        tok = Tokenizer(hf, eos, fast, lambda: _hf_tokenizer(path, cfg["model_type"], cached), template)
    if gemma:
        end_of_turn = tok.token_to_id("<end_of_turn>")
        if end_of_turn is not None:
            tok.eos_token_ids.add(end_of_turn)
    return tok


def _gguf_tokenizer(path: Path, model_type: str) -> tuple[PreTrainedTokenizerBase | None, FastTokenizer | None, Path]:
    """(the transformers tokenizer, None) or (None, its snapshot), and the directory of the converted copy."""
    st = path.stat()
    stamp = {"source": path.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    cached = path.with_name(path.name + ".tokenizer")
    stamp_file = cached / "pagedlm_source.json"
    try:
        if json.loads(stamp_file.read_text()) == stamp:
            if (fast := load_snapshot(cached)) is not None:
                return None, fast, cached
            hf = _saved_tokenizer(cached)
            save_snapshot(cached, hf)
            return hf, None, cached
    except (OSError, ValueError):
        pass
    if (vocab := _direct_vocab(path, model_type)) is not None:  # transformers' conversion, without transformers
        if _cache(path, cached, stamp, vocab.save):
            store_snapshot(cached, vocab.tokenizer, vocab.facts)
        return None, FastTokenizer(vocab.tokenizer, vocab.facts), cached
    hf = _gguf_tokenizer_class(model_type).from_pretrained(path.parent, gguf_file=path.name)
    if _cache(path, cached, stamp, hf.save_pretrained):
        save_snapshot(cached, hf)
    return hf, None, cached


def _direct_vocab(path: Path, model_type: str) -> GGUFVocab | None:
    try:
        reader = open_gguf(path)
        return build_vocab(path, reader.fields, model_type, reader.little_endian)
    except Exception as e:  # noqa: BLE001 - whatever the file holds: transformers converts it, as it would anyway
        logger.info("Tokenizer of %s: converted by transformers (%s: %s).", path, type(e).__name__, e)
        return None


def _cache(path: Path, cached: Path, stamp: dict, save: Callable[[Path], Any]) -> bool:
    """Write the converted tokenizer (`save(directory)`) and the GGUF's stamp as `cached`, atomically."""
    try:
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{cached.name}."))
    except OSError:
        return False
    try:
        save(tmp)
        (tmp / "pagedlm_source.json").write_text(json.dumps(stamp))
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o777 & ~mask)
        shutil.rmtree(cached, ignore_errors=True)
        os.replace(tmp, cached)
        return True
    except OSError:
        return False
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _hf_tokenizer(path: Path, model_type: str, cached: Path) -> PreTrainedTokenizerBase:
    """The transformers tokenizer of a GGUF started from a snapshot: the converted copy, else (it could not be
    written beside the file) converted again."""
    try:
        return _saved_tokenizer(cached)
    except OSError:
        return _gguf_tokenizer_class(model_type).from_pretrained(path.parent, gguf_file=path.name)


def _saved_tokenizer(cached: Path) -> PreTrainedTokenizerBase:
    """A tokenizer `_gguf_tokenizer` saved, loaded as the class it was saved from (what AutoTokenizer finds in its
    tokenizer_config.json, without importing AutoTokenizer's machinery: a third of a second)."""
    import transformers

    name = json.loads((cached / "tokenizer_config.json").read_text()).get("tokenizer_class")
    cls = getattr(transformers, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedTokenizerBase)):
        cls = transformers.AutoTokenizer
    return cls.from_pretrained(cached)


def _gguf_tokenizer_class(model_type: str) -> type:
    """The class AutoTokenizer builds a GGUF's tokenizer as (the one transformers names for the family, else
    TokenizersBackend), found from our config's model type: AutoTokenizer reads the whole file's metadata with gguf-py
    just for that (4 s for SmolLM2's, 20 s for Gemma 3's), the class's own conversion reads only the vocabulary."""
    import transformers
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING_NAMES

    name = TOKENIZER_MAPPING_NAMES.get(model_type)
    cls = getattr(transformers, name, None) if name else None
    if not isinstance(cls, type) or cls.__name__ in ("MistralCommonBackend", "PythonBackend"):
        return transformers.TokenizersBackend
    return cls
