"""ModelRunner.prepare's decode path (one new token per sequence, short block tables: the batch built from lists)
against its general numpy path: the same tensors, dtypes and lists, the same errors."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from pagedlm.engine import model_runner
from pagedlm.engine.model_runner import Chunk, ModelRunner
from pagedlm.kvcache.block_manager import NULL_BLOCK


class _Spec:
    def __init__(self, groups: int) -> None:
        self.groups = [object()] * groups


def bare_runner(block_size: int, groups: int) -> ModelRunner:
    """A runner with what `prepare` reads (it knows tensors, not the model)."""
    runner = ModelRunner.__new__(ModelRunner)
    runner.block_size, runner.device, runner.kv_spec = block_size, torch.device("cpu"), _Spec(groups)
    return runner


def decode_chunks(rng: random.Random, block_size: int, groups: int) -> list[Chunk]:
    """Up to 8 sequences at random positions; each group's table covers the position, maybe a block more; a
    second group has freed (NULL_BLOCK) entries before the window, as a sliding-window group does."""
    chunks = []
    for _ in range(rng.randint(1, 8)):
        pos = rng.randrange(0, 300)
        tables = []
        for g in range(groups):
            table = [rng.randrange(0, 5000) for _ in range(pos // block_size + 1 + rng.randrange(2))]
            if g == 1:
                freed = rng.randrange(pos // block_size + 1)
                table[:freed] = [NULL_BLOCK] * freed
            tables.append(table)
        chunks.append(Chunk([rng.randrange(50000)], pos, tables))
    return chunks


def prepare_both(runner: ModelRunner, chunks: list[Chunk], monkeypatch: pytest.MonkeyPatch):
    calls = []
    real = ModelRunner._prepare_decode
    monkeypatch.setattr(ModelRunner, "_prepare_decode", lambda self, c: calls.append(1) or real(self, c))
    monkeypatch.setattr(model_runner, "DECODE_LIST_MAX_ENTRIES", 10**9)  # the path, whatever the tables' size
    fast = runner.prepare(chunks)
    assert calls == [1], "the decode path ran"
    monkeypatch.setattr(model_runner, "DECODE_LIST_MAX_ENTRIES", -1)
    general = runner.prepare(chunks)
    assert calls == [1]
    return fast, general


def assert_same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b) and a.is_contiguous()
    else:
        assert a == b and type(a) is type(b)


@pytest.mark.parametrize("seed", range(24))
def test_decode_batch_from_lists_equals_the_general_path(seed, monkeypatch):
    rng = random.Random(seed)
    block_size, groups = rng.choice([1, 4, 16]), rng.choice([1, 2])
    runner = bare_runner(block_size, groups)
    chunks = decode_chunks(rng, block_size, groups)
    (ids, pos, metas), (ids_ref, pos_ref, metas_ref) = prepare_both(runner, chunks, monkeypatch)
    assert_same(ids, ids_ref)
    assert_same(pos, pos_ref)
    assert len(metas) == len(metas_ref) == groups
    for meta, ref in zip(metas, metas_ref):
        for f in dataclasses.fields(meta):
            assert_same(getattr(meta, f.name), getattr(ref, f.name))


@pytest.mark.parametrize("position, table, message", [(9, [7, 8], "past the end of its block table"),
                                                     (5, [7, NULL_BLOCK, 9], "slot is in a freed block")])
def test_decode_batch_errors_as_the_general_path(position, table, message, monkeypatch):
    runner = bare_runner(4, 1)
    chunks = [Chunk([5], 3, [[1]]), Chunk([6], position, [table])]
    with pytest.raises(RuntimeError, match=message):
        runner.prepare(chunks)
    monkeypatch.setattr(model_runner, "DECODE_LIST_MAX_ENTRIES", -1)
    with pytest.raises(RuntimeError, match=message):
        runner.prepare(chunks)


def test_a_single_stream_decode_step_takes_the_list_path(monkeypatch):
    """Up to 4,096 tokens of context at 16-token blocks (256 entries); a batch of 64 such sequences does not."""
    calls = []
    real = ModelRunner._prepare_decode
    monkeypatch.setattr(ModelRunner, "_prepare_decode", lambda self, c: calls.append(len(c)) or real(self, c))
    runner = bare_runner(16, 1)
    runner.prepare([Chunk([1], 4095, [list(range(256))])])
    runner.prepare([Chunk([1], 4095, [list(range(256))])] * 64)
    assert calls == [1]
