"""A GGUF's byte-level BPE vocabulary (`tokenizer.ggml.model` "gpt2": SmolLM2, Llama 3, ...) built straight from
its metadata into the Rust tokenizer and the facts that transformers' conversion gives, without importing
transformers (a second and more of a model's first start).

The tokenizer is built with the same `tokenizers` calls, in the same order and on the same values as transformers
5's conversion (`integrations/gguf`: a `GPT2Tokenizer` of the file's vocabulary and merges, its control and
user-defined tokens added, the split regex of `tokenizer.ggml.pre`; then the `TokenizersBackend` that
`from_pretrained(dir, gguf_file=...)` builds around it: the named special tokens, and the post-processor where the
file says whether to add BOS / EOS), so its serialization is the one transformers' tokenizer has.
`build` returns None, and transformers converts the file as before, for anything it does not reproduce: another
tokenizer model or config model type, a `tokenizer.ggml.pre` it does not know, a file transformers would read
differently or reject (text that is not UTF-8, a big-endian file, ids outside the vocabulary, no merges), files
beside the GGUF that transformers' `from_pretrained` would read too.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagedlm.hub.fast_tokenizer import TokenizerFacts

__all__ = ["MODEL_TYPES", "SPLITS", "GGUFVocab", "build", "byte_spelling"]

# Config model types whose GGUF tokenizer transformers builds as a plain `TokenizersBackend` (others: a class of
# their own, e.g. Qwen2Tokenizer, whose __init__ changes the result).
MODEL_TYPES = frozenset({"llama"})
_CONTROL, _USER_DEFINED = 3, 4
# `tokenizer.ggml.pre` values with GPT-2's own split (transformers has no regex of its own for them).
_PLAIN = frozenset({None, "default", "gpt-2", "smollm", "starcoder", "refact", "olmo"})
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN35 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
           r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_UPPER, _LOWER = r"[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]", r"[\p{Ll}\p{Lm}\p{Lo}\p{M}]"
_TEKKEN = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CONTRACTIONS = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
_GPT4O = (rf"[^\r\n\p{{L}}\p{{N}}]?{_UPPER}*{_LOWER}+{_CONTRACTIONS}"
          rf"|[^\r\n\p{{L}}\p{{N}}]?{_UPPER}+{_LOWER}*{_CONTRACTIONS}"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
# The split regex of each `tokenizer.ggml.pre` that transformers gives one (tests compare it with transformers').
SPLITS = {
    **dict.fromkeys(("llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "jina-v5-nano", "dbrx", "smaug-bpe"), _LLAMA3),
    "tekken": _TEKKEN,
    **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "megrez"), _QWEN2),
    "qwen35": _QWEN35,
    **dict.fromkeys(("gpt-4o", "llama4", "kanana2", "talkie", "minimax-m2"), _GPT4O),
}
_NAMED = ("bos_token", "eos_token", "unk_token", "pad_token")  # in transformers' order (sep, cls, mask: none)
_IDS = ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id")
# Names in the GGUF's directory that transformers' `from_pretrained(dir, gguf_file=...)` reads besides the file.
_BESIDE = re.compile(r"tokenizer\.json|tekken\.json|tokenizer\.model|tiktoken\.model")


@dataclass(frozen=True)
class GGUFVocab:
    tokenizer: Any  # tokenizers.Tokenizer, as transformers' tokenizer's `backend_tokenizer`
    facts: TokenizerFacts
    config: dict[str, Any]  # tokenizer_config.json as transformers' `save_pretrained` writes it
    chat_template: str | None  # chat_template.jinja

    def save(self, directory: Path) -> None:
        """The files transformers' `save_pretrained` writes for this tokenizer, as it writes them."""
        directory = Path(directory)
        config = json.dumps(self.config, indent=2, sort_keys=True, ensure_ascii=False) + "\n"
        (directory / "tokenizer_config.json").write_text(config, encoding="utf-8")
        if self.chat_template is not None:
            (directory / "chat_template.jinja").write_text(self.chat_template, encoding="utf-8")
        (directory / "tokenizer.json").write_text(self.tokenizer.to_str(pretty=True), encoding="utf-8")


def build(path: Path, fields: dict[str, Any], model_type: str, little_endian: bool = True) -> GGUFVocab | None:
    """The tokenizer transformers would convert the GGUF at `path` (metadata `fields`) to, or None where this
    does not reproduce it (see the module's docstring)."""
    meta = {k[len("tokenizer."):]: v for k, v in fields.items() if k.startswith("tokenizer.")}
    tokens, merges, types = meta.get("ggml.tokens"), meta.get("ggml.merges"), meta.get("ggml.token_type")
    template, pre = meta.get("chat_template"), meta.get("ggml.pre")
    if (model_type not in MODEL_TYPES or meta.get("ggml.model") != "gpt2" or not little_endian
            or not isinstance(fields.get("general.architecture"), str)
            or not (pre is None or isinstance(pre, str) and (pre in _PLAIN or pre in SPLITS))
            or not _strings(tokens) or not _strings(merges) or not (template is None or isinstance(template, str))
            or not (types is None or isinstance(types, list) and (not types or type(types[0]) is int))):
        return None
    if "\ufffd" in "".join(tokens) + "".join(merges) + (template or ""):
        return None  # not UTF-8 (our reader replaced it, transformers' raises), or a U+FFFD of its own
    special = {}
    for name, key in zip(_NAMED, _IDS):
        i = meta.get(f"ggml.{key}")
        if i is not None and not (type(i) is int and 0 <= i < len(tokens)):
            return None
        special[name] = tokens[i] if i is not None else None
    add = {k: meta[f"ggml.{k}"] for k in ("add_bos_token", "add_eos_token") if f"ggml.{k}" in meta}
    if _beside(path.parent):
        return None
    tok = _byte_level(tokens, merges, types or [], pre)
    return _backend(tok, special, add, template)


def _strings(values: Any) -> bool:
    """A GGUF array of strings (an array's values are all of one type)."""
    return isinstance(values, list) and (not values or type(values[0]) is str)


def _beside(directory: Path) -> bool:
    """Whether `directory` holds files transformers may read with the GGUF (a tokenizer or chat templates of its
    own; a config.json, which its check for Mistral's regex reads for vocabularies over 100k)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return True
    return any(_BESIDE.search(n) for n in names) or "additional_chat_templates" in names or "config.json" in names


def byte_spelling() -> dict[int, str]:
    """GPT-2's byte-level alphabet: each byte as the character a byte-level BPE vocabulary spells it with
    (printable Latin-1 as itself, the others from U+0100 on, in byte order)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + n) for n, b in enumerate(others)}}


def _byte_level(tokens: list[str], merges: list[str], types: list[int], pre: str | None):
    """transformers' GPT2Tokenizer of the vocabulary, with the file's control and user-defined tokens, split as
    `pre` says."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, pre_tokenizers, processors
    from tokenizers.models import BPE

    spelling = byte_spelling()
    alphabet = frozenset(spelling.values())
    outside = re.compile("[^" + re.escape("".join(sorted(alphabet))) + "]")
    if outside.search("".join(tokens)) is None:
        vocab = dict(zip(tokens, range(len(tokens))))
    else:  # tokens spelled as text (a space, a newline) respelled in the alphabet
        vocab = {t if outside.search(t) is None else "".join(spelling[b] for b in t.encode()): i
                 for i, t in enumerate(tokens)}
    tok = Tokenizer(BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges], dropout=None,
                        continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_tokens([AddedToken("<|endoftext|>", special=True)])  # GPT2Tokenizer's default unk/bos/eos
    tok.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    marked = [(t, k) for t, k in zip(tokens, types) if k in (_CONTROL, _USER_DEFINED)]
    control = [AddedToken(t, normalized=False, special=True) for t, k in marked
               if k == _CONTROL and outside.search(t) is None]
    if control:
        tok.add_special_tokens(control)
    if any(k == _USER_DEFINED for _, k in marked):
        known = tok.get_vocab(with_added_tokens=True)
        user = [AddedToken(t, normalized=False, special=False) for t, k in marked if k == _USER_DEFINED and t in known]
        if user:
            tok.add_tokens(user)
    if pre in SPLITS:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(SPLITS[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    return tok


def _backend(tok, special: dict[str, str | None], add: dict[str, Any], template: str | None) -> GGUFVocab:
    """What transformers' TokenizersBackend does around the converted tokenizer: its named special tokens added
    (as special where not yet added), the post-processor rebuilt where the file names add_bos/add_eos."""
    from tokenizers import AddedToken, processors

    added = {t.content for t in tok.get_added_tokens_decoder().values()}
    missing = list(dict.fromkeys(v for v in special.values() if v is not None and v not in added))
    if missing:
        tok.add_tokens([AddedToken(t, special=True) for t in missing])

    def ids(name: str) -> int | None:
        return tok.token_to_id(special[name]) if special[name] is not None else None

    if add:
        bos, eos = special["bos_token"], special["eos_token"]
        add_bos, add_eos = bool(add.get("add_bos_token")) and bos is not None, bool(
            add.get("add_eos_token")) and eos is not None
        single = f"{(bos + ':0 ') if add_bos else ''}$A:0{(' ' + eos + ':0') if add_eos else ''}"
        pair = f"{single}{(' ' + bos + ':1') if add_bos else ''} $B:1{(' ' + eos + ':1') if add_eos else ''}"
        pairs = [(bos, ids("bos_token"))] * add_bos + [(eos, ids("eos_token"))] * add_eos
        tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=pairs)
    unique = list(dict.fromkeys(v for v in special.values() if v is not None))
    facts = TokenizerFacts(ids("eos_token"), ids("bos_token"), ids("unk_token"),
                           [tok.token_to_id(t) for t in unique], tok.get_vocab_size(with_added_tokens=True),
                           template, False, False)
    return GGUFVocab(tok, facts, _config(special), template)


def _config(special: dict[str, str | None]) -> dict[str, Any]:
    from huggingface_hub.constants import is_offline_mode

    return {"backend": "tokenizers", **special, "is_local": True, "local_files_only": is_offline_mode(),
            "model_max_length": int(1e30), "tokenizer_class": "TokenizersBackend"}
