"""The fused stack finishes only the rows the logits read: past the last layer's K/V write, a prefill chunk's
other tokens are dropped (llama.cpp does the same), and what remains is bit for bit what the full stack gives."""
from __future__ import annotations

import pytest
import torch

from pagedlm import LLM, SamplingParams
from pagedlm.attention.metadata import AttentionMetadata
from pagedlm.engine.model_runner import Chunk
from pagedlm.model.llama_decode import LlamaDecodeKernel, load_decode_kernel

pytestmark = pytest.mark.skipif(load_decode_kernel() is None, reason="fused decode kernel unavailable")


@pytest.fixture(scope="module")
def tiny_gemma_dir(tmp_path_factory):
    from conftest import build_tiny_gemma3

    return build_tiny_gemma3(tmp_path_factory.mktemp("tiny_gemma3_out_rows"), sliding_window=8,
                             max_position_embeddings=256)


def _meta(query_lens: list[int]) -> AttentionMetadata:
    n = len(query_lens)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    return AttentionMetadata(slot_mapping=torch.zeros(sum(query_lens), dtype=torch.int64),
                             block_tables=torch.zeros(n, 1, dtype=torch.int32), seq_lens=torch.tensor(query_lens),
                             query_start_loc=qsl, seq_lens_list=list(query_lens), query_lens_list=list(query_lens),
                             max_query_len=max(query_lens), max_seq_len=max(query_lens), block_size=16)


def test_suffix_query_start_loc():
    """Rows that are each sequence's last query tokens, in order, give their offsets; anything else None."""
    meta = _meta([4, 1, 3])  # rows 0-3, 4, 5-7
    assert meta.suffix_query_start_loc([3, 4, 7]) == [0, 1, 2, 3]
    assert meta.suffix_query_start_loc([2, 3, 6, 7]) == [0, 2, 2, 4]
    assert meta.suffix_query_start_loc([]) == [0, 0, 0, 0]
    assert meta.suffix_query_start_loc(list(range(8))) == [0, 4, 5, 8]
    for rows in ([2], [3, 7, 4], [3, 3], [2, 4], [7, 8], [5, 7], [4, 3]):
        assert meta.suffix_query_start_loc(rows) is None, rows


def same(a: torch.Tensor, b: torch.Tensor) -> None:
    """Bit for bit (a random int8 cache's scale bytes may spell NaN, equal to itself here)."""
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


def _batch(model_dir, family: str, quantization, kv_cache_dtype: str):
    llm = LLM(str(model_dir), dtype="float32", num_kv_blocks=64, block_size=8, quantization=quantization,
              kv_cache_dtype=kv_cache_dtype)
    runner = llm.engine.runner
    torch.manual_seed(0)
    for kv in runner.layer_caches:
        for c in kv:
            c.copy_(torch.randn(c.shape).to(c.dtype))
    groups = max(runner.layer_group) + 1  # Gemma 3: sliding-window layers and global ones
    chunks = [Chunk(token_ids=[7, 8, 9, 10, 11, 12], start=9, block_tables=[[3, 7]] * groups),
              Chunk(token_ids=[20], start=30, block_tables=[[5, 1, 8, 2]] * groups),
              Chunk(token_ids=[21, 22, 23], start=0, block_tables=[[6]] * groups)]
    input_ids, positions, metas = runner.prepare(chunks)
    return runner, input_ids, positions, [metas[g] for g in runner.layer_group]


@pytest.mark.parametrize("quantization,kv_cache_dtype", [(None, "auto"), ("int4", "bfloat16"), ("int8", "int8"),
                                                         (None, "float16")])
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_stack_finishes_only_the_rows_read(family, tiny_model_dir, tiny_gemma_dir, quantization, kv_cache_dtype):
    """Each sequence's last n tokens (n = 0 included) come out of the stack equal to the same rows of a full run,
    and every row's K/V is written as in the full run (Gemma 3: two KV cache groups)."""
    runner, input_ids, positions, metas = _batch(tiny_model_dir if family == "llama" else tiny_gemma_dir, family,
                                                 quantization, kv_cache_dtype)
    model, caches = runner.model, runner.layer_caches
    before = [tuple(c.clone() for c in kv) for kv in caches]

    def run(out_qsl):
        for kv, b in zip(caches, before):
            for c, s in zip(kv, b):
                c.copy_(s)
        x, normed, only_out = model.run_layers(model.embed(input_ids).contiguous(), positions, caches, metas,
                                               runner.attn_backend, out_qsl)
        assert normed and only_out == (out_qsl is not None)
        return x.clone(), [tuple(c.clone() for c in kv) for kv in caches]

    full, full_caches = run(None)
    for rows in ([5, 6, 9], [4, 5, 6, 8, 9], [9], [], [6]):
        out_qsl = metas[0].suffix_query_start_loc(rows)
        assert out_qsl is not None
        out, out_caches = run(torch.tensor(out_qsl, dtype=torch.int32))
        same(out[:len(rows)], full[rows])
        for kv, kv_full in zip(out_caches, full_caches):
            for c, f in zip(kv, kv_full):
                same(c, f)


def test_stack_refuses_rows_a_sequence_does_not_have(tiny_model_dir):
    """More out rows than a sequence's query tokens, or offsets not starting at 0: ValueError before anything is
    written."""
    runner, input_ids, positions, metas = _batch(tiny_model_dir, "llama", None, "auto")
    model, caches = runner.model, runner.layer_caches
    kernel = model.decode_kernel()
    rope = model.rotary.cos_sin(positions, torch.float32)
    saved = [tuple(c.clone() for c in kv) for kv in caches]
    for bad in ([0, 1, 3, 4], [1, 2, 3, 4], [0, 2, 1, 2]):
        x = model.embed(input_ids).contiguous()
        x0 = x.clone()
        with pytest.raises(ValueError, match="fused decode kernel"):
            kernel.run(x, *rope, caches, metas, torch.tensor(bad, dtype=torch.int32))
        assert torch.equal(x, x0)
        for kv, b in zip(caches, saved):
            assert all(torch.equal(c, s) for c, s in zip(kv, b))


def test_generation_is_the_same_and_prefill_drops_rows(tiny_model_dir, monkeypatch):
    """Prompts prefilled in chunks beside decoding sequences: the steps that drop rows ran (fewer rows out than
    in), and the tokens and logprobs equal a run that finishes every row."""
    dropped = []
    original = LlamaDecodeKernel.run

    def run(self, x, cos, sin, kv_caches, metas, out_qsl=None):
        if out_qsl is not None:
            dropped.append(x.shape[0] - int(out_qsl[-1]))
        return original(self, x, cos, sin, kv_caches, metas, out_qsl)

    monkeypatch.setattr(LlamaDecodeKernel, "run", run)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    prompts = [[(i * 7 + j * 3) % 200 + 5 for j in range(20 + 9 * i)] for i in range(4)]
    runs = []
    for drop in (True, False):
        if not drop:
            monkeypatch.setattr(AttentionMetadata, "suffix_query_start_loc", lambda self, rows: None)
        # a fresh engine each time: the same steps (no prefix cache hits), so the same rows per LM head product
        llm = LLM(str(tiny_model_dir), dtype="float32", num_kv_blocks=128, block_size=8, max_num_batched_tokens=24,
                  speculative_config="off")
        dropped.clear()
        runs.append([o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)])
        assert (max(dropped, default=0) > 0) == drop
    for a, b in zip(*runs):
        assert a.token_ids == b.token_ids
        assert [{t: p.logprob for t, p in d.items()} for d in a.logprobs] == \
               [{t: p.logprob for t, p in d.items()} for d in b.logprobs]
