"""Tokenizer: a thin wrapper over a Hugging Face fast tokenizer, loaded from an HF dir or a GGUF file."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedlm.hub.loader import load_hf_config

if TYPE_CHECKING:  # transformers is imported when a tokenizer is loaded (a second of start-up), not with pagedlm
    from transformers import PreTrainedTokenizerBase

__all__ = ["GEMMA_CHAT_TEMPLATE", "Tokenizer", "load_tokenizer"]

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
    """Token ids are exactly those of the wrapped HF tokenizer `hf`."""

    def __init__(self, hf: PreTrainedTokenizerBase, eos_token_ids: Iterable[int] = ()) -> None:
        self.hf = hf
        self.eos_token_ids: set[int] = _ids(eos_token_ids) | _ids(hf.eos_token_id)
        self.bos_token_id: int | None = hf.bos_token_id
        self.vocab_size: int = len(hf)

    @property
    def has_chat_template(self) -> bool:
        return bool(self.hf.chat_template)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def decode_batch(self, batch: Sequence[Sequence[int]], skip_special_tokens: bool = True) -> list[str]:
        """Each of `batch` decoded on its own, in one call to the Rust tokenizer where there is one (for display:
        no clean-up of tokenization spaces)."""
        batch = [list(ids) for ids in batch]
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is not None:
            return backend.decode_batch(batch, skip_special_tokens=skip_special_tokens)
        return self.hf.batch_decode(batch, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list[dict] | None = None, chat_template: str | None = None,
                            **template_vars: Any) -> str:
        """Render `messages` ([{"role": ..., "content": ...}]) to a prompt string (not tokenized); `tools`
        (OpenAI's function definitions) are the template's `tools` variable; `chat_template` replaces the
        tokenizer's own for this call; `template_vars` are more variables of the template."""
        if tools:
            template_vars["tools"] = tools
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

    For a GGUF file, the vocabulary converted by transformers is cached next to it in
    `<file>.tokenizer/` (written atomically, rebuilt if the GGUF changes).
    """
    path = Path(path)
    cfg = load_hf_config(path)
    eos = _ids(cfg["eos_token_id"])
    if path.is_dir():
        gen = path / "generation_config.json"
        if gen.is_file():
            eos |= _ids(json.loads(gen.read_text()).get("eos_token_id"))
        from transformers import AutoTokenizer

        hf = AutoTokenizer.from_pretrained(path)
    else:
        hf = _gguf_tokenizer(path, cfg["model_type"])
    if str(cfg["model_type"]).startswith("gemma"):
        hf.chat_template = hf.chat_template or GEMMA_CHAT_TEMPLATE
        end_of_turn = hf.convert_tokens_to_ids("<end_of_turn>")
        if isinstance(end_of_turn, int) and end_of_turn != hf.unk_token_id:
            eos.add(end_of_turn)
    return Tokenizer(hf, eos)


def _gguf_tokenizer(path: Path, model_type: str) -> PreTrainedTokenizerBase:
    st = path.stat()
    stamp = {"source": path.name, "size": st.st_size, "mtime_ns": st.st_mtime_ns}
    cached = path.with_name(path.name + ".tokenizer")
    stamp_file = cached / "pagedlm_source.json"
    try:
        if json.loads(stamp_file.read_text()) == stamp:
            return _saved_tokenizer(cached)
    except (OSError, ValueError):
        pass
    hf = _gguf_tokenizer_class(model_type).from_pretrained(path.parent, gguf_file=path.name)
    try:
        tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{cached.name}."))
    except OSError:
        return hf
    try:
        hf.save_pretrained(tmp)
        (tmp / "pagedlm_source.json").write_text(json.dumps(stamp))
        mask = os.umask(0)
        os.umask(mask)
        os.chmod(tmp, 0o777 & ~mask)
        shutil.rmtree(cached, ignore_errors=True)
        os.replace(tmp, cached)
    except OSError:
        pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return hf


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
