import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from pagedlm.sampling.detokenizer import IncrementalDetokenizer, find_stop, held_back

CORPUS = [
    "héllo wörld 日本語 🙂",
    "The quick brown fox jumps over the lazy dog. Hello world!",
    "naïve café über straße, crème brûlée",
    "こんにちは世界 日本語の文章です。",
    "emoji 🙂🙃🎉 party time",
    "def f(x):\n    return x * 2\n",
]
TEXT_CHARS = "abc xyz.,!\nhéöü日本語こんにちは🙂🎉"


@pytest.fixture(scope="module")
def tok() -> PreTrainedTokenizerFast:
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>"],
        show_progress=False,
    )
    bpe.train_from_iterator(CORPUS * 10, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|endoftext|>",
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
    )


def stream(tok, prompt_ids, ids, skip=True):
    d = IncrementalDetokenizer(tok, prompt_ids, skip_special_tokens=skip)
    deltas = [d.append(i) for i in ids]
    return d, deltas


def byte_ids(tok, text: str) -> list[int]:
    """One token per UTF-8 byte (the byte-level alphabet)."""
    enc = tok.backend_tokenizer.pre_tokenizer.pre_tokenize_str(text)
    chars = "".join(piece for piece, _ in enc)
    return tok.convert_tokens_to_ids(list(chars))


@settings(max_examples=300, deadline=None)
@given(
    prompt=st.text(alphabet=TEXT_CHARS, max_size=20),
    ids=st.lists(st.integers(0, 400), max_size=30),  # includes a few ids past the vocab (padded model vocab)
    skip=st.booleans(),
)
def test_deltas_concatenate_to_decode(tok, prompt, ids, skip):
    d, deltas = stream(tok, tok.encode(prompt), ids, skip)
    expected = tok.decode(ids, skip_special_tokens=skip)
    streamed = "".join(deltas)
    assert d.text == streamed
    assert expected.startswith(streamed)
    if "\ufffd" not in expected:
        assert streamed == expected
    assert not any(x.endswith("\ufffd") for x in deltas)  # a partial char is never emitted
    assert streamed + d.flush() == expected == d.text


@settings(max_examples=100, deadline=None)
@given(text=st.text(alphabet=TEXT_CHARS, max_size=40), prompt=st.text(alphabet=TEXT_CHARS, max_size=10))
def test_valid_text_streams_exactly(tok, text, prompt):
    for ids in (tok.encode(text), byte_ids(tok, text)):
        d, deltas = stream(tok, tok.encode(prompt), ids)
        assert "".join(deltas) == text == d.text
        assert "\ufffd" not in "".join(deltas)
        assert d.flush() == ""


def test_multibyte_char_held_until_complete(tok):
    ids = byte_ids(tok, "a日🙂")
    assert len(ids) == 8
    d, deltas = stream(tok, [], ids)
    assert deltas == ["a", "", "", "日", "", "", "", "🙂"]


def test_first_token_keeps_leading_space(tok):
    prompt = tok.encode("The quick brown")
    ids = tok.encode(" fox jumps")
    d, deltas = stream(tok, prompt, ids)
    assert deltas[0].startswith(" ") and d.text == " fox jumps"


def test_metaspace_leading_space_from_prompt_context():
    # SentencePiece-style decoders drop the leading space at the start of a string; with the prompt as
    # context the first output token keeps it (the text continues the prompt, as in vLLM).
    sp = Tokenizer(models.BPE(unk_token="<unk>"))
    sp.pre_tokenizer = pre_tokenizers.Metaspace()
    sp.decoder = decoders.Metaspace()
    sp.train_from_iterator(CORPUS * 10, trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>"],
                                                            show_progress=False))
    tok = PreTrainedTokenizerFast(tokenizer_object=sp, unk_token="<unk>", clean_up_tokenization_spaces=False)
    prompt, ids = tok.encode("The quick brown"), tok.encode("fox jumps")
    assert tok.decode(ids) == "fox jumps"
    assert tok.decode(prompt + ids) == "The quick brown fox jumps"
    assert stream(tok, prompt, ids)[0].text == " fox jumps"
    assert stream(tok, [], ids)[0].text == "fox jumps"


def test_special_tokens(tok):
    eos = tok.eos_token_id
    im = tok.convert_tokens_to_ids("<|im_start|>")
    ids = [im] + tok.encode("hello") + [eos] + tok.encode(" world")
    d, deltas = stream(tok, [im] + tok.encode("x"), ids, skip=True)
    assert d.text == "hello world" == tok.decode(ids, skip_special_tokens=True)
    assert deltas[0] == ""
    d, deltas = stream(tok, [eos], ids, skip=False)
    assert d.text == "<|im_start|>hello<|endoftext|> world" == tok.decode(ids)


def test_out_of_vocab_id_decodes_to_nothing(tok):
    d, deltas = stream(tok, tok.encode("a"), tok.encode("hi") + [len(tok) + 10] + tok.encode(" there"))
    assert d.text == "hi there"


def test_find_stop_across_token_boundaries():
    stops = ["o w", "zzz"]
    text = ""
    results = []
    for delta in ["Hel", "lo wo", "rld"]:
        text += delta
        results.append(find_stop(text, len(delta), stops, include_stop=False))
    assert results == [None, ("Hell", "o w"), None]
    assert find_stop("Hello wo", 5, stops, include_stop=True) == ("Hello w", "o w")
    assert find_stop("Hello wo", 1, stops, include_stop=False) is None  # ended before the delta: found earlier
    assert find_stop("Hello wo", 0, stops, include_stop=False) is None
    assert find_stop("abc", 3, [], include_stop=False) is None


def test_find_stop_picks_earliest():
    assert find_stop("xx STOP yy END", 14, ["END", "STOP"], False) == ("xx ", "STOP")
    assert find_stop("xx STOP yy END", 14, ["END", "STOP"], True) == ("xx STOP", "STOP")
    assert find_stop("aXbX", 2, ["X"], False) == ("aXb", "X")  # only stops ending in the new text count


def test_held_back():
    assert held_back("Hello wor", ["world!"]) == 3
    assert held_back("Hello wor", ["world!", "r"]) == 3
    assert held_back("Hello", ["xyz"]) == 0
    assert held_back("ab", ["abc", "bcd"]) == 2
    assert held_back("abc", []) == 0
    assert held_back("", ["abc"]) == 0
    assert held_back("aa", ["a"]) == 0  # a one-char stop can't be pending


@settings(max_examples=400, deadline=None)
@given(
    text=st.text(alphabet="ab c", max_size=30),
    stops=st.lists(st.text(alphabet="ab c", min_size=1, max_size=4), max_size=3),
    cuts=st.lists(st.integers(0, 30), max_size=10),
    include=st.booleans(),
)
def test_streaming_stop_properties(text, stops, cuts, include):
    bounds = sorted({0, len(text), *(c for c in cuts if c <= len(text))})
    acc, emitted, found = "", [], None
    for a, b in zip(bounds, bounds[1:]):
        acc += text[a:b]
        found = find_stop(acc, b - a, stops, include)
        if found:
            break
        emitted.append(acc[: len(acc) - held_back(acc, stops)])
    if found is None:
        assert not any(s in text for s in stops)
        final = text
    else:
        final, stop = found
        cut = final[: len(final) - len(stop)] if include else final
        assert acc[len(cut) :].startswith(stop)
        assert not any(s in cut for s in stops)  # nothing earlier should have stopped
    assert all(final.startswith(e) for e in emitted)  # a stream never takes text back
