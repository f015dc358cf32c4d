"""Each token's bytes (hub/token_bytes.py) against llguidance's reading of the same tokenizer, over the whole
vocabulary, for byte-level BPEs (the tiny tokenizer; SmolLM2's GGUF, GPT-2's alphabet) and a SentencePiece one with
byte fallback (Gemma 3's GGUF): tokens holding part of a character give its bytes, not U+FFFD's."""
from __future__ import annotations

import pytest

from pagedlm.hub.tokenizer import load_tokenizer

TEXT = "東京 café 🙂 naïve 𓀀"  # the hieroglyph: bytes alone in every vocabulary here


def check_against_llguidance(tok) -> None:
    import llguidance.hf

    reference = llguidance.hf.from_tokenizer(tok.hf)
    special = set(tok.all_special_ids)
    for tid in range(len(tok.hf)):
        ours, theirs = tok.token_bytes(tid), reference.decode_bytes([tid])
        if tid not in special and not (ours == b"\xff" and theirs == b""):  # llguidance keeps 0xFF for its markers
            assert ours == theirs, tid
    ids = tok.encode(TEXT, add_special_tokens=False)
    assert b"".join(tok.token_bytes(t) for t in ids).decode() == TEXT
    split = [t for t in ids if tok.decode([t]) == "\ufffd"]  # part of a character: U+FFFD alone, its bytes here
    assert split and all(tok.token_bytes(t) != "\ufffd".encode() for t in split)


def test_byte_level_bpe(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    check_against_llguidance(tok)
    assert tok.token_bytes(tok.token_to_id("<|endoftext|>")) == b"<|endoftext|>"


@pytest.mark.slow
def test_byte_level_bpe_of_a_gguf(smollm2_path):
    tok = load_tokenizer(smollm2_path)
    check_against_llguidance(tok)
    assert tok.token_bytes(tok.token_to_id("<|im_end|>")) == b"<|im_end|>"


@pytest.mark.slow
def test_sentencepiece_with_byte_fallback(gemma3_path):
    tok = load_tokenizer(gemma3_path)
    check_against_llguidance(tok)
    assert tok.token_bytes(tok.token_to_id("<0xE6>")) == b"\xe6" and tok.token_bytes(tok.token_to_id("▁a")) == b" a"
