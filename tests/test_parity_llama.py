"""SmolLM2-135M (real weights, fp32): greedy tokens and top-5 logprobs equal HF transformers' on the same GGUF."""
from __future__ import annotations

import pytest
from hf_reference import assert_matches_hf, hf_greedy

from pagedlm import LLM, SamplingParams

pytestmark = pytest.mark.slow

NEW_TOKENS = 32

LONG_TEXT = (
    "The history of computing is a story of abstraction. Early machines were programmed by rewiring panels; "
    "later, stored programs let the same hardware run many tasks. Operating systems then introduced virtual "
    "memory, which splits memory into fixed-size pages and maps each process's logical pages to physical "
    "frames, so that memory is allocated on demand and fragmentation stays small. "
)


def chat(tok, text: str) -> list[int]:
    return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}]), add_special_tokens=False)


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return LLM(str(smollm2_path), dtype="float32", num_kv_blocks=512)


@pytest.fixture(scope="module")
def prompts(llm) -> list[list[int]]:
    tok = llm.get_tokenizer()
    raw = ["The capital of France is", "def fibonacci(n):", "1, 2, 3, 4, 5,", LONG_TEXT * 5 + "In summary,"]
    chats = ["What is 2+2?", "Write a haiku about the sea.", "Explain paged attention in one sentence.",
             "Summarize this text: " + LONG_TEXT * 3]
    ids = [tok.encode(p) for p in raw] + [chat(tok, c) for c in chats]
    assert max(len(i) for i in ids) > 300 and min(len(i) for i in ids) < 10
    return ids


@pytest.fixture(scope="module")
def hf_reference(smollm2_hf, prompts):
    """Greedy continuation with HF transformers (its own GGUF loading and modeling code), step by step."""
    return hf_greedy(smollm2_hf, prompts, NEW_TOKENS)


PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)


def test_batched_greedy_matches_hf(llm, prompts, hf_reference):
    assert_matches_hf(llm.generate(prompts, PARAMS, use_tqdm=False), hf_reference)


def test_one_by_one_greedy_matches_hf(llm, prompts, hf_reference):
    outs = [llm.generate(p, PARAMS, use_tqdm=False)[0] for p in prompts]
    assert_matches_hf(outs, hf_reference)


def test_reference_attention_backend_matches_hf(smollm2_path, prompts, hf_reference):
    llm = LLM(str(smollm2_path), dtype="float32", num_kv_blocks=256, attention_backend="reference")
    assert_matches_hf(llm.generate(prompts[:3], PARAMS, use_tqdm=False), hf_reference[:3])
