"""A GGUF's byte-level BPE vocabulary built without transformers (hub/gguf_vocab.py) is the tokenizer transformers'
conversion gives: the same Rust tokenizer (its serialization), the same answers on a varied corpus and over the
whole vocabulary, the same facts and the same files in `<file>.tokenizer/`; files it does not reproduce are still
converted by transformers."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import pytest
from conftest import _TINY_CORPUS
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import models, pre_tokenizers, trainers
from transformers import TokenizersBackend
from transformers.integrations.gguf import gguf_tokenizer_mapping

from pagedlm.hub import gguf_vocab, tokenizer
from pagedlm.hub.fast_tokenizer import BACKEND, SNAPSHOT, TokenizerFacts, load_snapshot
from pagedlm.hub.tokenizer import _gguf_tokenizer, _gguf_tokenizer_class, load_tokenizer

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<|a b|>", "<|pad|>"]
CORPUS = [
    "Hello world, how are you?", "", " ", "   leading and trailing   ", "\n\n\t tabs\r\nand CRLF\n   \n",
    "Ünïcödé — 日本語のテキスト, 한국어, Ελληνικά, русский", "emoji 🤖🙂👍🏽 and ZWJ 👩‍💻 flags 🇫🇷",
    "digits 1234567890 3.14159 1,000,000 2024-06-01 007", "def f(x):\n    return x**2  # comment\n\tpass",
    "for (int i = 0; i < n; ++i) { a[i] = b[i] * 2; }", "don't , it's . ok ? I'M WE'LL they'd",
    "aaaaaaaaaaaaaaaa",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n", "<|endoftext|>x<|im_end|><|endoftext|>",
    "<think>reasoning</think> answer", "<|a b|> <|pad|>", "mixed<|im_start|>no space", "\u00a0nbsp\u2009thin\u3000wide",
    "combining e\u0301 a\u0308 \ufeffbom", "\x00\x01 control \x7f chars",
]


def _trained_vocab() -> tuple[list[str], list[str]]:
    """A byte-level BPE (tokens in id order, merges) as llama.cpp writes one into a GGUF."""
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=420, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    raw.train_from_iterator(_TINY_CORPUS.splitlines(), trainer=trainer)
    model = json.loads(raw.to_str())["model"]
    tokens = sorted(model["vocab"], key=model["vocab"].get)
    return tokens, [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]


VARIANTS = {
    # SmolLM2's shape: control tokens first, no add_eos, GPT-2's split
    "smollm": dict(pre="smollm", ids=dict(bos=1, eos=2, unk=0, pad=2), add_bos=False),
    # Llama 3's: BOS added, its split regex, no unk, no <|endoftext|> in the vocabulary (transformers appends it)
    "llama-bpe": dict(pre="llama-bpe", ids=dict(bos=1, eos=2), add_bos=True, drop="<|endoftext|>"),
    "qwen2-eos": dict(pre="qwen2", ids=dict(bos=1, eos=2, pad=6), add_bos=False, add_eos=True),
    "tekken": dict(pre="tekken", ids=dict(eos=2, unk=0), add_eos=True),
    "gpt-4o": dict(pre="gpt-4o", ids=dict(bos=3, eos=4), add_bos=True, add_eos=True),
    # no pre, no token types, no chat template; a named token spelled with a space (transformers adds it)
    "bare": dict(pre=None, ids=dict(bos=5, eos=0), types=False, template=False),
    # a control token spelled with a space, user-defined tokens, duplicates, text tokens with whitespace
    "odd": dict(pre="default", ids=dict(bos=1, eos=2, unk=5), dupes=True, add_bos=True),
}


def write_vocab_gguf(path: Path, pre: str | None = None, ids: dict | None = None, add_bos: bool | None = None,
                     add_eos: bool | None = None, types: bool = True, template: bool = True, drop: str | None = None,
                     dupes: bool = False, model: str = "gpt2") -> Path:
    """A GGUF holding a tokenizer only (no tensors): the tiny corpus's byte-level BPE after SPECIALS."""
    tokens, merges = _trained_vocab()
    specials = [s for s in SPECIALS if s != drop]
    tokens = specials + tokens + ["\n", " \t", "Ġhello world"] + (["Ġthe", "<think>"] if dupes else [])
    kinds = [3, 3, 3, 4, 4, 3, 3][:len(specials)] if drop is None else [3] * len(specials)
    kinds += [1] * (len(tokens) - len(kinds))
    if dupes:
        kinds[-1] = 4
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tokenizer_model(model)
    if pre is not None:
        w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    if types:
        w.add_token_types(kinds)
    w.add_token_merges(merges)
    adders = {"bos": w.add_bos_token_id, "eos": w.add_eos_token_id, "unk": w.add_unk_token_id,
              "pad": w.add_pad_token_id}
    for name, i in (ids or {}).items():
        adders[name](i)
    if add_bos is not None:
        w.add_add_bos_token(add_bos)
    if add_eos is not None:
        w.add_add_eos_token(add_eos)
    if template:
        w.add_chat_template("{% for m in messages %}{{ '<|im_start|>' + m['content'] + '<|im_end|>' }}{% endfor %}")
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def facts_of(hf) -> TokenizerFacts:
    return TokenizerFacts(hf.eos_token_id, hf.bos_token_id, hf.unk_token_id, list(hf.all_special_ids), len(hf),
                          hf.chat_template, bool(hf.clean_up_tokenization_spaces), bool(hf.split_special_tokens))


def assert_same(path: Path, model_type: str = "llama") -> gguf_vocab.GGUFVocab:
    """The direct build of `path` against transformers' conversion of it, in every respect the engine sees."""
    reader = tokenizer.open_gguf(path)
    vocab = gguf_vocab.build(path, reader.fields, model_type)
    assert vocab is not None
    hf = _gguf_tokenizer_class(model_type).from_pretrained(path.parent, gguf_file=path.name)
    assert type(hf) is TokenizersBackend
    assert vocab.tokenizer.to_str() == hf.backend_tokenizer.to_str()
    assert vocab.facts == facts_of(hf)
    fast = tokenizer.FastTokenizer(vocab.tokenizer, vocab.facts)
    for text in CORPUS:
        for special in (True, False):
            ids = hf.encode(text, add_special_tokens=special)
            assert fast.encode(text, special) == ids, text
            for skip in (True, False):
                assert fast.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)
    everything = list(range(len(hf) + 2))
    assert fast.convert_ids_to_tokens(everything) == hf.convert_ids_to_tokens(everything)
    for i in range(0, len(hf), 7):  # partial UTF-8: lone byte tokens and runs of ids cut anywhere
        piece = everything[i:min(i + 3, len(hf))]
        for skip in (True, False):
            assert fast.decode(piece, skip) == hf.decode(piece, skip_special_tokens=skip)
        tokens = [t for t in hf.convert_ids_to_tokens(piece) if t is not None]  # ids respelled onto others: holes
        assert fast.convert_tokens_to_string(tokens) == hf.convert_tokens_to_string(tokens)
    for token, i in hf.get_vocab().items():
        assert fast.token_to_id(token) == i
    assert fast.token_to_id("no such token") is None
    return vocab


@pytest.mark.parametrize("variant", VARIANTS)
def test_direct_build_is_transformers_conversion(variant: str, tmp_path: Path) -> None:
    path = write_vocab_gguf(tmp_path / f"{variant}.gguf", **VARIANTS[variant])
    vocab = assert_same(path)
    if variant == "llama-bpe":  # not in the file: added as transformers' GPT2Tokenizer adds it
        assert "<|endoftext|>" in {t.content for t in vocab.tokenizer.get_added_tokens_decoder().values()}
    ours, theirs = tmp_path / "ours", tmp_path / "theirs"
    ours.mkdir()
    vocab.save(ours)
    TokenizersBackend.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(theirs)
    assert sorted(os.listdir(ours)) == sorted(os.listdir(theirs))
    for name in os.listdir(theirs):
        assert (ours / name).read_bytes() == (theirs / name).read_bytes(), name


def test_split_regexes_are_transformers() -> None:
    assert gguf_vocab.SPLITS == gguf_tokenizer_mapping.GGUF_PRE_TOKENIZER_SPLITS
    assert not gguf_vocab._PLAIN & set(gguf_tokenizer_mapping.GGUF_PRE_TOKENIZER_SPLITS)
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    assert gguf_vocab.byte_spelling() == bytes_to_unicode()
    for model_type in gguf_vocab.MODEL_TYPES:
        assert _gguf_tokenizer_class(model_type) is TokenizersBackend


@pytest.mark.parametrize("case", ["spm", "unknown pre", "model type", "tokenizer.json beside", "no merges"])
def test_unsupported_vocabularies_go_through_transformers(case: str, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    kwargs = {"pre": "some-new-pre"} if case == "unknown pre" else {}
    path = write_vocab_gguf(tmp_path / "v.gguf", ids=dict(bos=1, eos=2), **kwargs)
    fields = tokenizer.open_gguf(path).fields
    model_type = "qwen2" if case == "model type" else "llama"
    if case == "spm":
        fields = {**fields, "tokenizer.ggml.model": "llama"}
    if case == "no merges":
        fields = {k: v for k, v in fields.items() if k != "tokenizer.ggml.merges"}
    if case == "tokenizer.json beside":
        (tmp_path / "tokenizer.json").write_text("{}")
    assert gguf_vocab.build(path, fields, model_type) is None
    if case in ("unknown pre", "model type"):  # the load itself: transformers converts it
        converted = []
        real = tokenizer._gguf_tokenizer_class
        monkeypatch.setattr(tokenizer, "_gguf_tokenizer_class", lambda t: converted.append(t) or real(t))
        hf, fast, cached = _gguf_tokenizer(path, model_type)
        assert converted == [model_type] and hf is not None and fast is None
        assert load_snapshot(cached) is not None  # and snapshot as before


def test_not_utf8_goes_through_transformers(tmp_path: Path) -> None:
    path = write_vocab_gguf(tmp_path / "v.gguf", ids=dict(bos=1, eos=2))
    data = path.read_bytes()
    at = data.index(b"<|pad|>")
    path.write_bytes(data[:at] + b"<|\xff\xfe\xfd|>" + data[at + 7:])  # same length: still a well-formed file
    reader = tokenizer.open_gguf(path)
    assert gguf_vocab.build(path, reader.fields, "llama") is None
    with pytest.raises(UnicodeDecodeError):  # as transformers reads it
        TokenizersBackend.from_pretrained(path.parent, gguf_file=path.name)


def test_direct_first_start_writes_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first start builds without transformers and leaves the converted copy and the snapshot: the second
    start reads the snapshot, and `Tokenizer.hf` loads transformers' tokenizer from the copy."""
    path = write_vocab_gguf(tmp_path / "v.gguf", **VARIANTS["llama-bpe"])
    monkeypatch.setattr(tokenizer, "_gguf_tokenizer_class", lambda t: pytest.fail("converted by transformers"))
    hf, fast, cached = _gguf_tokenizer(path, "llama")
    assert hf is None and fast is not None
    assert {BACKEND, SNAPSHOT, "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
            "pagedlm_source.json"} == set(os.listdir(cached))
    again = load_snapshot(cached)
    assert again is not None and again.facts == fast.facts
    assert again.backend.to_str() == fast.backend.to_str()
    saved = tokenizer._hf_tokenizer(path, "llama", cached)
    assert facts_of(saved) == fast.facts and saved.backend_tokenizer.to_str() == fast.backend.to_str()
    hf2, fast2, _ = _gguf_tokenizer(path, "llama")
    assert hf2 is None and fast2.facts == fast.facts


def test_unwritable_cache_converts_on_first_use(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_vocab_gguf(tmp_path / "v.gguf", **VARIANTS["smollm"])
    monkeypatch.setattr(tokenizer, "_cache", lambda *args: False)  # e.g. a read-only model directory
    hf, fast, cached = _gguf_tokenizer(path, "llama")
    assert hf is None and fast is not None and not cached.exists()
    late = tokenizer._hf_tokenizer(path, "llama", cached)
    assert late.backend_tokenizer.to_str() == fast.backend.to_str()


@pytest.mark.slow
def test_smollm2_direct(smollm2_path: Path, tmp_path: Path) -> None:
    """SmolLM2's vocabulary, built directly, is transformers' conversion; its first start from a fresh copy imports
    no transformers, and the chat template (transformers' tokenizer, loaded on first use) still renders."""
    assert_same(smollm2_path)
    link = tmp_path / smollm2_path.name
    link.symlink_to(smollm2_path)
    code = ("import sys; from pagedlm.hub.tokenizer import load_tokenizer; t = load_tokenizer(sys.argv[1]); "
            "print(t._fast is not None, 'transformers' in sys.modules, t.encode('Hello world'), "
            "sorted(t.eos_token_ids)); t.apply_chat_template([{'role': 'user', 'content': 'hi'}]); "
            "print('transformers' in sys.modules)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    for _ in range(2):  # first start (direct), second (snapshot)
        out = subprocess.run([sys.executable, "-c", code, str(link)], env=env, capture_output=True, text=True,
                             check=True).stdout.split("\n")
        assert out[:2] == ["True False [19556, 905] [2]", "True"]
    ref = load_tokenizer(smollm2_path)
    tok = load_tokenizer(link)
    msgs = [{"role": "user", "content": "hi"}]
    assert tok.apply_chat_template(msgs) == ref.apply_chat_template(msgs)
