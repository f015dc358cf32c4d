"""The tokenizer snapshot (hub/fast_tokenizer.py): a second start restores a GGUF's converted tokenizer without
transformers and answers exactly as transformers' tokenizer does; a damaged, stale or unsafe snapshot is not used
(transformers loads the tokenizer, and the snapshot is taken again)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import build_tiny_tokenizer
from transformers import TokenizersBackend

from pagedlm.hub import fast_tokenizer
from pagedlm.hub.fast_tokenizer import BACKEND, SNAPSHOT, load_snapshot, save_snapshot
from pagedlm.hub.tokenizer import Tokenizer, load_tokenizer
from pagedlm.sampling.detokenizer import IncrementalDetokenizer

TEXTS = ["Hello world, how are you?", "  leading spaces\n\n\ttabs and trailing  ", "Ünïcödé — 日本語 🤖 emoji",
         "<|im_start|>user\nhi<|im_end|>\n", "", "don't , it's . ok ?", "<|endoftext|>x<|im_end|>"]


@pytest.fixture
def converted(tmp_path: Path) -> Path:
    """A directory as `load_tokenizer` leaves a converted GGUF tokenizer (transformers' files, then ours)."""
    build_tiny_tokenizer().save_pretrained(tmp_path / "tok")
    return tmp_path / "tok"


def _snapshot(directory: Path):
    hf = TokenizersBackend.from_pretrained(directory)
    assert save_snapshot(directory, hf)
    return hf


def test_snapshot_answers_as_transformers(converted: Path) -> None:
    hf = _snapshot(converted)
    fast = load_snapshot(converted)
    assert fast is not None
    tok = Tokenizer(None, (), fast, lambda: pytest.fail("transformers loaded"))
    for text in TEXTS:
        for special in (True, False):
            assert tok.encode(text, special) == hf.encode(text, add_special_tokens=special)
        ids = hf.encode(text) + [0, 1, 2, 511, 600]  # special and out-of-vocabulary ids too
        for skip in (True, False):
            assert tok.decode(ids, skip) == hf.decode(ids, skip_special_tokens=skip)
        assert tok.convert_ids_to_tokens(ids) == hf.convert_ids_to_tokens(ids)
        streams = []
        for t in (hf, tok):  # the engine's detokenizer, over either
            d = IncrementalDetokenizer(t, [5, 6], skip_special_tokens=True)
            streams.append([d.append(i) for i in ids] + [d.flush()])
        assert streams[0] == streams[1]
    assert sorted(tok.all_special_ids) == sorted(hf.all_special_ids)
    assert tok.vocab_size == len(hf) and tok.bos_token_id == hf.bos_token_id and tok.eos_token_ids == {0}
    assert tok.chat_template == hf.chat_template and tok.has_chat_template
    assert tok.token_to_id("<|im_end|>") == 2 and tok.token_to_id("no such token") is None


def test_transformers_loads_on_first_use_with_the_default_template(converted: Path) -> None:
    _snapshot(converted)
    loads = []

    def load():
        loads.append(1)
        hf = TokenizersBackend.from_pretrained(converted)
        hf.chat_template = None
        return hf

    tok = Tokenizer(None, (), load_snapshot(converted), load, default_chat_template="{{ 'x' }}")
    tok.encode("hi")
    assert not loads
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == "x"
    tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert loads == [1]


def test_damaged_snapshot_is_not_used(converted: Path) -> None:
    _snapshot(converted)
    backend = converted / BACKEND
    data = bytearray(backend.read_bytes())
    data[len(data) // 2] ^= 1
    backend.write_bytes(bytes(data))
    assert load_snapshot(converted) is None
    backend.write_bytes(bytes(data[:1000]))  # truncated
    assert load_snapshot(converted) is None
    (converted / SNAPSHOT).write_text("{not json")
    assert load_snapshot(converted) is None


@pytest.mark.parametrize("change", ["config", "added file", "versions", "format"])
def test_stale_snapshot_is_not_used(converted: Path, change: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _snapshot(converted)
    assert load_snapshot(converted) is not None
    if change == "config":  # an edited config (e.g. another chat template): its size and mtime change
        config = converted / "tokenizer_config.json"
        config.write_text(config.read_text().replace("}", ', "x": 1}', 1))
    elif change == "added file":
        (converted / "special_tokens_map.json").write_text("{}")
    elif change == "versions":
        monkeypatch.setattr(fast_tokenizer, "_versions", lambda: {"transformers": "0", "tokenizers": "0"})
    else:
        meta = json.loads((converted / SNAPSHOT).read_text())
        (converted / SNAPSHOT).write_text(json.dumps({**meta, "format": 0}))
    assert load_snapshot(converted) is None


def test_no_snapshot_where_the_class_differs(converted: Path) -> None:
    class Overriding(TokenizersBackend):
        def _decode(self, token_ids, skip_special_tokens=False, **kwargs):
            return super()._decode(token_ids, skip_special_tokens, **kwargs).upper()

    assert not save_snapshot(converted, Overriding.from_pretrained(converted))
    assert not (converted / SNAPSHOT).exists()


@pytest.mark.slow
def test_smollm2_second_load_without_transformers(smollm2_path: Path) -> None:
    """A GGUF's second load reads the snapshot and imports neither transformers nor torch; a damaged snapshot is
    replaced by the next load (through transformers), and the one after reads it again."""
    cached = smollm2_path.with_name(smollm2_path.name + ".tokenizer")
    load_tokenizer(smollm2_path)
    code = ("import sys; from pagedlm.hub.tokenizer import load_tokenizer; t = load_tokenizer(sys.argv[1]); "
            "print(t._fast is not None, 'transformers' in sys.modules, 'torch' in sys.modules, "
            "t.encode('Hello world'))")

    def load() -> str:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        return subprocess.run([sys.executable, "-c", code, str(smollm2_path)], env=env, capture_output=True,
                              text=True, check=True).stdout.strip()

    assert load() == "True False False [19556, 905]"
    backend = cached / BACKEND
    backend.write_bytes(backend.read_bytes()[:-10])
    assert _through_transformers(load())  # and a new snapshot
    assert load() == "True False False [19556, 905]"
    shutil.copy(cached / SNAPSHOT, cached / (SNAPSHOT + ".bak"))  # a file the snapshot did not see: stale
    try:
        assert _through_transformers(load())
    finally:
        (cached / (SNAPSHOT + ".bak")).unlink()
    assert load().startswith("False True")  # the directory changed back: the snapshot taken with .bak is stale
    assert load() == "True False False [19556, 905]"


def _through_transformers(line: str) -> bool:
    return line.startswith("False True") and line.endswith("[19556, 905]")
