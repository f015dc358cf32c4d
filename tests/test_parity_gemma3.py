"""Gemma 3 270M (real weights, fp32): weights bit-identical to transformers' own GGUF loading; greedy tokens and
top-5 logprobs equal HF's, for prompts shorter and longer than the 512-token sliding window, batched and alone."""
from __future__ import annotations

import pytest
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.config import ModelConfig
from pagedlm.model.loader import iter_weights, load_hf_config

pytestmark = pytest.mark.slow

NEW_TOKENS = 24

LONG_TEXT = (
    "The history of computing is a story of abstraction. Early machines were programmed by rewiring panels; "
    "later, stored programs let the same hardware run many tasks. Operating systems then introduced virtual "
    "memory, which splits memory into fixed-size pages and maps each process's logical pages to physical "
    "frames, so that memory is allocated on demand and fragmentation stays small. "
)


@pytest.fixture(scope="module")
def hf_model(gemma3_path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(gemma3_path.parent, gguf_file=gemma3_path.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def llm(gemma3_path):
    return LLM(str(gemma3_path), dtype="float32", num_kv_blocks=160)


@pytest.fixture(scope="module")
def prompts(llm) -> list[list[int]]:
    tok = llm.get_tokenizer()
    chat = tok.apply_chat_template([{"role": "user", "content": "Write a haiku about the sea."}])
    ids = [tok.encode("The capital of France is"), tok.encode(chat, add_special_tokens=False),
           tok.encode(LONG_TEXT * 9 + "\nQuestion: what does virtual memory split memory into?\nAnswer:")]
    assert ids[1][:3] == [tok.bos_token_id, *tok.encode("<start_of_turn>user", add_special_tokens=False)]
    assert len(ids[2]) > 600, "the long prompt must exceed the 512-token sliding window"
    return ids


@pytest.fixture(scope="module")
def hf_reference(hf_model, prompts):
    """Greedy continuation with HF transformers (its own modeling code and KV cache), step by step."""
    results = []
    with torch.inference_mode():
        for ids in prompts:
            out = hf_model(torch.tensor([ids]), use_cache=True)
            past, tokens, logprobs = out.past_key_values, [], []
            logits = out.logits[0, -1]
            for _ in range(NEW_TOKENS):
                lp = torch.log_softmax(logits.float(), -1)
                tok = int(lp.argmax())
                tokens.append(tok)
                logprobs.append(lp)
                out = hf_model(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
                past, logits = out.past_key_values, out.logits[0, -1]
            results.append((tokens, logprobs))
    return results


def test_config_matches_hf(gemma3_path, hf_model, llm):
    ours, hf = ModelConfig.from_hf(load_hf_config(gemma3_path)), hf_model.config
    assert ours.layer_types == hf.layer_types and ours.sliding_window == hf.sliding_window == 512
    assert ours.rope_theta == hf.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert ours.rope_local_base_freq == hf.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert (ours.head_dim, ours.query_pre_attn_scalar, ours.num_kv_heads) == (hf.head_dim, hf.query_pre_attn_scalar,
                                                                             hf.num_key_value_heads)
    assert ours.final_logit_softcapping == hf.final_logit_softcapping
    model = llm.engine.runner.model
    assert model.sliding_window == 512
    assert model.layer_sliding_windows == [None if t == "full_attention" else 512 for t in hf.layer_types]


def test_weights_bit_identical_to_hf_gguf_loading(gemma3_path, hf_model):
    hf = hf_model.state_dict()
    names = set()
    for name, tensor in iter_weights(gemma3_path, torch.float32):
        assert torch.equal(tensor, hf[name]), name
        names.add(name)
    assert names == set(hf) - {"lm_head.weight"}  # tied to the embeddings


def check_against_hf(outputs, hf_reference):
    for out, (hf_tokens, hf_logprobs) in zip(outputs, hf_reference):
        comp = out.outputs[0]
        assert comp.token_ids == hf_tokens
        for step, (ours, ref) in enumerate(zip(comp.logprobs, hf_logprobs)):
            top5 = torch.topk(ref, 5)
            for lp, tid in zip(top5.values.tolist(), top5.indices.tolist()):
                assert tid in ours, f"step {step}: HF top-5 token {tid} missing from ours"
                assert abs(ours[tid].logprob - lp) < 1e-3, (step, tid, ours[tid].logprob, lp)


PARAMS = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=5)


def test_batched_greedy_matches_hf(llm, prompts, hf_reference):
    check_against_hf(llm.generate(prompts, PARAMS, use_tqdm=False), hf_reference)


def test_one_by_one_greedy_matches_hf(llm, prompts, hf_reference):
    check_against_hf([llm.generate(p, PARAMS, use_tqdm=False)[0] for p in prompts], hf_reference)


def test_chat_uses_gemma_turn_format(llm):
    out = llm.chat([{"role": "user", "content": "Say hi."}], SamplingParams(temperature=0.0, max_tokens=4),
                   use_tqdm=False)[0]
    tail = llm.get_tokenizer().encode("<end_of_turn>\n<start_of_turn>model\n", add_special_tokens=False)
    assert out.prompt_token_ids[-len(tail):] == tail
