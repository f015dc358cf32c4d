"""The engine loop: schedule -> build the flat batch -> forward -> sample -> append / stop -> finish and free
(Scheduler.update_from_output). Detokenization, stop checks and outputs are the OutputProcessor's."""
from __future__ import annotations

import gc
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, fields
from typing import Iterable

import torch

from pagedlm.config import DEFAULT_MODEL, EngineConfig
from pagedlm.engine.admission import AdmissionLimits, KVCacheShape, check_admission
from pagedlm.engine.model_runner import Chunk, ModelRunner
from pagedlm.engine.output_processor import OutputProcessor
from pagedlm.engine.scheduler import FinishedSeq, ScheduledSeq, Scheduler, SchedulerOutput
from pagedlm.engine.sequence import Request, Sequence, SequenceStatus
from pagedlm.hub.registry import resolve_model
from pagedlm.hub.tokenizer import load_tokenizer
from pagedlm.kvcache.block_manager import BlockManager
from pagedlm.kvcache.plan import plan_kv_cache
from pagedlm.kvcache.sizing import AvailableMemory, available_memory
from pagedlm.model.plan import plan_execution
from pagedlm.outputs import PositionLogprobs, RequestOutput
from pagedlm.sampling.beam_search import BeamSearch
from pagedlm.sampling.params import SamplingParams
from pagedlm.sampling.sampler import Sampler, SamplingRow, allowed_mask
from pagedlm.sampling.structured import StructuredOutputManager

logger = logging.getLogger(__name__)


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_swapped: int
    kv_cache_usage: float
    num_free_blocks: int
    num_total_blocks: int
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    moe_expert_tokens: dict[int, list[int]] = field(default_factory=dict)  # MoE layer -> tokens per expert


@dataclass
class SampleRow:
    """A scheduled chunk that completes its sequence: the next token is sampled from logits row `index`."""

    sched: ScheduledSeq
    index: int

    @property
    def request(self) -> Request:
        return self.sched.request

    @property
    def seq(self) -> Sequence:
        return self.sched.seq


@dataclass
class PromptLogprobRow:
    """Prompt positions first .. end - 1 computed in this step, at logits rows index .. index + end - first - 1:
    they give the logprobs of prompt tokens first + 1 .. end."""

    sched: ScheduledSeq
    index: int
    first: int
    end: int

    @property
    def request(self) -> Request:
        return self.sched.request

    @property
    def rows(self) -> slice:
        return slice(self.index, self.index + self.end - self.first)


@dataclass
class StepBatch:
    """One step's model input (a chunk per scheduled sequence) and the logits rows it reads back."""

    chunks: list[Chunk] = field(default_factory=list)
    logits_index: list[int] = field(default_factory=list)  # positions in the flat batch whose logits come back
    prompt_logprobs: list[PromptLogprobRow] = field(default_factory=list)
    samples: list[SampleRow] = field(default_factory=list)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        path = resolve_model(config.model)
        self.model_path = path
        self.plan = plan_execution(config, path)
        self.dtype = self.plan.dtype
        logger.info("%s", self.plan.describe())
        self.tokenizer = load_tokenizer(path)
        host_memory = available_memory()  # before the weights load: the KV budget is sized against what they leave
        self.runner = ModelRunner(config, path, self.plan)
        self.model_config = self.runner.model_config
        spec = self.runner.kv_spec

        device = self.runner.device
        memory = (AvailableMemory(torch.cuda.mem_get_info(device)[0], "CUDA free") if device.type == "cuda"
                  else host_memory)
        kv = plan_kv_cache(config, self.model_config, spec, self.runner.weight_bytes(), memory, device.type)
        self.kv_budget, self.memory_report = kv.budget, kv.report  # ValueError above: nothing allocated
        num_blocks, num_cpu_blocks = kv.num_blocks, kv.num_cpu_blocks
        self.runner.allocate_kv_cache(num_blocks, num_cpu_blocks)
        self.block_manager = BlockManager(num_blocks, config.block_size, num_cpu_blocks, config.watermark,
                                          config.enable_prefix_caching, spec.sliding_windows)
        self.scheduler = Scheduler(config, self.block_manager)
        self.max_model_len = max_len = kv.max_model_len
        self.eos_token_ids = set(self.tokenizer.eos_token_ids) | set(self.model_config.eos_token_ids)
        self.sampler = Sampler(self.eos_token_ids, seed=config.seed)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids, max_len)
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._requests: dict[str, Request] = {}
        self._failed: dict[str, RequestOutput] = {}  # requests failed in the current step
        self._finishing: list[FinishedSeq] = []  # sequences that ended in the current step
        self._structured: StructuredOutputManager | None = None
        self.mask_seconds_total = 0.0  # time spent computing grammar masks
        self._mask_thread: ThreadPoolExecutor | None = None
        self._pending_masks: tuple[dict[int, int], Future | torch.Tensor] | None = None
        self._mask_errors: list[tuple[Request, Exception]] = []
        self._structured_lock = threading.Lock()
        logger.info("%s", self.memory_report.format())
        # What start-up built (tokenizer tables, model, plan) lives as long as the engine: out of the cyclic
        # collector's way, whose passes over it cost ~10% of a short step (as vLLM's engine core does).
        gc.collect()
        gc.freeze()

    @property
    def structured(self) -> StructuredOutputManager:
        """The constrained-decoding compiler (built on first use: wrapping the vocabulary takes about a second)."""
        with self._structured_lock:
            if self._structured is None:
                self._structured = StructuredOutputManager(self.tokenizer.hf, self.model_config.vocab_size,
                                                           self.eos_token_ids)
            return self._structured

    @classmethod
    def from_args(cls, model: str = DEFAULT_MODEL, **kwargs) -> "LLMEngine":
        known = {f.name for f in fields(EngineConfig)}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"Unknown engine arguments: {sorted(unknown)}")
        return cls(EngineConfig(model=model, **kwargs))

    # --- requests --------------------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None) -> None:
        """Validate and queue a request. Raises ValueError (nothing queued) on bad input."""
        params = params or SamplingParams()
        params.validate()
        self._check_limits(params)
        self.prepare_params(params)
        if request_id in self._requests:
            raise ValueError(f"Request id {request_id!r} is already in use.")
        if isinstance(prompt, str):
            text, token_ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, token_ids = None, list(prompt)
            vocab = self.model_config.vocab_size
            if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
                raise ValueError(f"Prompt token ids must be integers in [0, {vocab}).")
        if not token_ids:
            raise ValueError("The prompt is empty.")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"The prompt has {len(token_ids)} tokens; this model's maximum context length is "
                             f"{self.max_model_len} tokens, including at least one generated token.")
        kv = KVCacheShape.of(self.block_manager, self.config.max_num_batched_tokens)
        check_admission([len(token_ids)], params, AdmissionLimits(self.max_model_len, self.config.max_num_seqs, kv))
        req = Request(request_id, text, token_ids, params, priority=priority, cache_salt=cache_salt,
                      arrival_time=time.monotonic() if arrival_time is None else arrival_time)
        if params.use_beam_search:
            if params.beam_width > min(self.config.max_num_seqs, self.config.max_num_batched_tokens):
                raise ValueError(f"beam_width {params.beam_width} exceeds max_num_seqs / max_num_batched_tokens.")
            max_tokens = min(params.max_tokens, self.max_model_len - len(token_ids))
            req.beam = BeamSearch(params.beam_width, params.length_penalty, params.early_stopping, max_tokens,
                                  set() if params.ignore_eos else set(self.eos_token_ids))
        req.seqs.append(self._new_seq(req, 0))
        self._requests[request_id] = req
        self.scheduler.add_request(req)

    def _check_limits(self, params: SamplingParams) -> None:
        cfg = self.config
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > cfg.max_logprobs:
                raise ValueError(f"{name} {k} exceeds this engine's max_logprobs ({cfg.max_logprobs}).")
        for name in ("stop", "stop_token_ids"):
            if len(getattr(params, name)) > cfg.max_stop_sequences:
                raise ValueError(f"{name} holds {len(getattr(params, name))} entries; at most "
                                 f"{cfg.max_stop_sequences} are allowed (max_stop_sequences).")
        if any(len(stop) > cfg.max_stop_length for stop in params.stop):
            raise ValueError(f"A stop string is longer than max_stop_length ({cfg.max_stop_length} characters).")

    def prepare_params(self, params: SamplingParams) -> None:
        """Check the token controls against this model's vocabulary, tokenize bad_words and compile the
        constraint (cached). Raises ValueError naming the problem. Safe to call from any thread, and again."""
        prepare_params(params, self.model_config.vocab_size, self.tokenizer, lambda: self.structured)

    def _new_seq(self, req: Request, index: int) -> Sequence:
        params = req.params
        gen = None
        if params.seed is not None:
            gen = torch.Generator(device=self.runner.device)
            gen.manual_seed(params.seed + index)
        seq = Sequence(list(req.prompt_token_ids), index=index, generator=gen, cache_salt=req.cache_salt)
        seq.detokenizer = self.output_processor.detokenizer(req)
        return seq

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            self.abort_output(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    # --- the step ------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        try:
            kv = self.runner.kv_cache
            kv.swap_out(sched.blocks_to_swap_out)
            kv.swap_in(sched.blocks_to_swap_in)
            kv.copy_blocks(sched.blocks_to_copy)
            if sched.is_empty:
                return []
            batch = self._build_batch(sched)
            self._start_masks(batch.samples)  # on a worker thread, while the forward pass runs
            try:
                logits = self.runner.execute(batch.chunks, batch.logits_index)
            finally:  # the matchers are the engine thread's again (forks copy them)
                masks = self._pending_masks[1].result() if self._pending_masks is not None else None
        except BaseException:
            self.scheduler.step_failed(sched)  # its blocks' hashes were registered before their KV was written
            raise
        for s in sched.scheduled:
            s.seq.num_computed_tokens += s.num_new_tokens

        if masks is not None:
            self._pending_masks = (self._pending_masks[0], masks)
        self._failed = {}
        try:
            for req, e in self._mask_errors:
                self._fail(req, e)
            self._mask_errors = []
            self._record_prompt_logprobs(batch.prompt_logprobs, logits)
            touched = self._sample(batch.samples, logits)
        finally:
            self._update_scheduler()
        return self._finish_step(touched)

    def _build_batch(self, sched: SchedulerOutput) -> StepBatch:
        """The flat batch of the scheduled chunks, and the logits rows the step needs: prompt logprobs of the
        prompt positions computed now, and one row per chunk that completes its sequence (to sample from)."""
        batch = StepBatch()
        now = time.monotonic()
        offset = 0
        for s in sched.scheduled:
            req, start = s.request, s.seq.num_computed_tokens
            batch.chunks.append(Chunk(s.seq.token_slice(start, start + s.num_new_tokens), start,
                                      self.block_manager.get_block_tables(s.seq)))
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
                self.prompt_tokens_total += len(req.prompt_token_ids)
            if req.wants_prompt_logprobs and start < len(req.prompt_token_ids):
                first = max(start, len(req.prompt_logprobs) - 1 if req.prompt_logprobs else 0)
                end = min(start + s.num_new_tokens, len(req.prompt_token_ids) - 1)
                if end > first:
                    batch.prompt_logprobs.append(PromptLogprobRow(s, len(batch.logits_index), first, end))
                    batch.logits_index.extend(range(offset + first - start, offset + end - start))
            if s.completes:
                batch.samples.append(SampleRow(s, len(batch.logits_index)))
                batch.logits_index.append(offset + s.num_new_tokens - 1)
            offset += s.num_new_tokens
        return batch

    def _fail(self, req: Request, error: Exception) -> None:
        """End one request of the step with an error (its blocks freed); the other requests go on."""
        if req.request_id in self._failed:
            return
        logger.error("Request %s failed (%s: %s); the rest of the batch goes on", req.request_id,
                     type(error).__name__, error, exc_info=error)
        self._update_scheduler()  # its samples that ended before it failed keep their finish reason
        self.scheduler.abort_request(req.request_id)
        self._requests.pop(req.request_id, None)
        out = self.output_processor.request_output(req, True)
        out.error = f"{type(error).__name__} while running request {req.request_id}"
        self._failed[req.request_id] = out

    def _finish(self, seq: Sequence, status: SequenceStatus) -> None:
        """`seq` ends with `status` at the end of this step (the scheduler frees its blocks then)."""
        self._finishing.append(FinishedSeq(seq, status))

    def _update_scheduler(self) -> None:
        self.scheduler.update_from_output(self._finishing)
        self._finishing = []

    def _record_prompt_logprobs(self, rows: list[PromptLogprobRow], logits: torch.Tensor) -> None:
        for row in rows:
            try:
                self.output_processor.add_prompt_logprobs(row.request, logits[row.rows], row.first, row.end)
            except Exception as e:  # noqa: BLE001 - isolate the request
                self._fail(row.request, e)

    def _fork(self, req: Request, parent: Sequence) -> Sequence:
        """A new sample of `req` that continues `parent`: its tokens, score and grammar state, sharing all its
        KV blocks (copied on write). Forks the `n` samples after the prefill, and beams chosen twice."""
        child = self._new_seq(req, len(req.seqs))
        child.output_token_ids = list(parent.output_token_ids)
        child.cumulative_logprob = parent.cumulative_logprob
        child.num_computed_tokens = parent.num_computed_tokens
        child.status = SequenceStatus.RUNNING
        if parent.matcher is not None:
            child.matcher = parent.matcher.deep_copy()
        self.block_manager.fork(parent, child)
        req.seqs.append(child)
        return child

    def _fork_samples(self, req: Request, seq: Sequence) -> list[Sequence]:
        """The sequences a request samples for: its first sample fans out into `n`."""
        if req.forked:
            return [seq]
        req.forked = True
        return [seq] + [self._fork(req, seq) for _ in range(1, req.params.n)]

    def _sample(self, rows: list[SampleRow], logits: torch.Tensor) -> dict[str, Request]:
        touched: dict[str, Request] = {}
        sample_rows: list[SamplingRow] = []
        targets: list[tuple[Request, Sequence]] = []
        index: list[int] = []
        beams: dict[str, list[SampleRow]] = {}
        for row in rows:
            req = row.request
            if req.request_id in self._failed:
                continue
            if req.beam is not None:
                beams.setdefault(req.request_id, []).append(row)
                continue
            if req.params.max_tokens == 0:  # scoring only (echo + prompt_logprobs): every sample ends empty
                for seq in self._fork_samples(req, row.seq):
                    self.output_processor.finish_text(seq)
                    self._finish(seq, SequenceStatus.FINISHED_LENGTH)
                touched[req.request_id] = req
                continue
            try:
                seqs = self._fork_samples(req, row.seq)
            except Exception as e:  # noqa: BLE001 - isolate the request
                self._fail(req, e)
                continue
            for seq in seqs:
                sample_rows.append(SamplingRow(req.params, req.prompt_token_ids, seq.output_token_ids, seq.generator))
                targets.append((req, seq))
                index.append(row.index)
        self._fill_masks(sample_rows, targets)
        for rid, beam_rows in beams.items():
            req = self._requests[rid]
            try:
                self._beam_step(req, beam_rows, logits)
                touched[rid] = req
            except Exception as e:  # noqa: BLE001 - isolate the request
                self._fail(req, e)
        if not sample_rows:
            return touched
        if index != list(range(logits.shape[0])):  # else every row once, in order: no copy of the logits
            logits = logits[index]
        tokens, chosen_logprobs, top_logprobs = self._sample_rows(logits, sample_rows, targets)
        now = time.monotonic()
        for k, (req, seq) in enumerate(targets):
            if req.request_id in self._failed:
                continue
            try:
                self._append_token(req, seq, tokens[k], chosen_logprobs[k], top_logprobs[k], now)
                touched[req.request_id] = req
            except Exception as e:  # noqa: BLE001 - isolate the request
                self._fail(req, e)
        return touched

    def _append_token(self, req: Request, seq: Sequence, token: int, logprob: float,
                      top: PositionLogprobs | None, now: float) -> None:
        if seq.matcher is not None and not seq.matcher.consume_token(token):
            raise RuntimeError(f"token {token} breaks the constraint: {seq.matcher.get_error()}")
        seq.output_token_ids.append(token)
        seq.cumulative_logprob += logprob
        if top is not None:
            seq.logprobs.append(self.output_processor.decode_logprobs(top))
        self.generation_tokens_total += 1
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.last_token_time = now
        status = self.output_processor.check_stop(req, seq, token)
        if status is None and seq.matcher is not None and seq.matcher.is_stopped():
            self.output_processor.finish_text(seq)  # the grammar allows nothing more
            status = SequenceStatus.FINISHED_STOPPED
        if status is not None:
            self._finish(seq, status)

    def _start_masks(self, rows: list[SampleRow]) -> None:
        """Start computing the grammar masks of the sequences this step samples for, on the mask thread (the
        library drops the GIL), so that they overlap the forward pass. Sequences without a matcher yet get one
        (a fresh matcher, replayed over the output they already have)."""
        seqs = []
        for row in rows:
            p = row.request.params
            if p.structured_outputs is None or p.max_tokens == 0 or row.request.beam is not None:
                continue
            try:
                if row.seq.matcher is None:
                    row.seq.matcher = self.structured.replay(p.structured_outputs, row.seq.output_token_ids)
                seqs.append(row.seq)
            except Exception as e:  # noqa: BLE001 - isolate the request (failed once the batch has run)
                self._mask_errors.append((row.request, e))
        self._pending_masks = None
        if seqs:
            if self._mask_thread is None:
                self._mask_thread = ThreadPoolExecutor(1, thread_name_prefix="pagedlm-masks")
            matchers = [seq.matcher for seq in seqs]
            self._pending_masks = ({seq.seq_id: j for j, seq in enumerate(seqs)},
                                   self._mask_thread.submit(self._timed_fill, matchers))

    def _timed_fill(self, matchers: list) -> torch.Tensor:
        t0 = time.perf_counter()
        bitmask = self.structured.fill_bitmask(matchers)
        self.mask_seconds_total += time.perf_counter() - t0
        return bitmask

    def _fill_masks(self, rows: list[SamplingRow], targets: list[tuple[Request, Sequence]]) -> None:
        """Each constrained row's grammar bitmask: from the masks started before the forward pass, plus (in one
        call) those of sequences forked in this step."""
        pending, self._pending_masks = self._pending_masks, None
        index, bitmask = ({}, None) if pending is None else pending
        late = [k for k, (_, seq) in enumerate(targets) if seq.matcher is not None and seq.seq_id not in index]
        for k, (_, seq) in enumerate(targets):
            if seq.seq_id in index:
                rows[k].bitmask = bitmask[index[seq.seq_id]]
        if late:
            extra = self._timed_fill([targets[k][1].matcher for k in late])
            for j, k in enumerate(late):
                rows[k].bitmask = extra[j]

    def _sample_rows(self, logits: torch.Tensor, rows: list[SamplingRow],
                     targets: list[tuple[Request, Sequence]]) -> tuple[list, list, list]:
        """The sampler over the whole batch; if it raises, again per request, so that only the requests it
        fails for fail (their rows come back as None)."""
        try:
            out = self.sampler(logits, rows)
            return out.token_ids, out.logprobs, out.top_logprobs
        except Exception:  # noqa: BLE001 - find the culprit below
            logger.warning("Batched sampling failed; sampling request by request", exc_info=True)
        tokens, logprobs, top = [None] * len(rows), [None] * len(rows), [None] * len(rows)
        groups: dict[str, list[int]] = {}
        for k, (req, _) in enumerate(targets):
            groups.setdefault(req.request_id, []).append(k)
        for ks in groups.values():
            req = targets[ks[0]][0]
            try:
                out = self.sampler(logits[ks], [rows[k] for k in ks])
            except Exception as e:  # noqa: BLE001 - isolate the request
                self._fail(req, e)
                continue
            for j, k in enumerate(ks):
                tokens[k], logprobs[k], top[k] = out.token_ids[j], out.logprobs[j], out.top_logprobs[j]
        return tokens, logprobs, top

    def _beam_step(self, req: Request, rows: list[SampleRow], logits: torch.Tensor) -> None:
        """Advance a beam search by one token: the chosen continuations reuse their parent's sequence, or
        fork it (sharing all its blocks) when a parent is chosen twice; unchosen beams finish (freeing their
        blocks)."""
        beam: BeamSearch = req.beam
        parents = [row.seq for row in rows]
        logprobs = torch.log_softmax(logits[[row.index for row in rows]].float(), dim=-1)
        chosen = beam.step(logprobs, [p.cumulative_logprob for p in parents], [p.output_token_ids for p in parents])
        now = time.monotonic()
        if req.metrics.first_token_time is None:
            req.metrics.first_token_time = now
        req.metrics.last_token_time = now
        self.generation_tokens_total += len(parents)
        targets, used = [], set()
        for cand in chosen:
            parent = parents[cand.parent]
            if parent.seq_id in used:
                targets.append((self._fork(req, parent), cand))
            else:
                used.add(parent.seq_id)
                targets.append((parent, cand))
        for seq in parents:
            if seq.seq_id not in used:
                self._finish(seq, SequenceStatus.FINISHED_STOPPED)
        for seq, cand in targets:
            seq.output_token_ids.append(cand.token)
            seq.cumulative_logprob = cand.logprob
        req.seqs = [seq for seq, _ in targets] or parents
        if beam.done:  # nothing was chosen: every beam finished above
            req.beam_outputs = self.output_processor.beam_outputs(req)

    def _finish_step(self, touched: dict[str, Request]) -> list[RequestOutput]:
        outputs = []
        now = time.monotonic()
        for req in touched.values():
            if req.request_id in self._failed:
                continue
            done = req.finished
            if done:
                req.metrics.finished_time = now
                self._requests.pop(req.request_id, None)
            outputs.append(self.output_processor.request_output(req, done))
        for out in self._failed.values():
            out.metrics.finished_time = now
            outputs.append(out)
        self._failed = {}
        return outputs

    def abort_output(self, request_id: str) -> RequestOutput | None:
        """Abort and return the request's final output (finish_reason 'abort'), or None if unknown."""
        req = self.scheduler.abort_request(request_id)
        if req is None:
            return None
        self._requests.pop(request_id, None)
        return self.output_processor.request_output(req, True)

    def get_stats(self) -> EngineStats:
        sch = self.scheduler
        bm = self.block_manager
        return EngineStats(
            num_running=sum(len(r.live_seqs) for r in sch.running), num_waiting=len(sch.waiting),
            num_swapped=len(sch.swapped), kv_cache_usage=bm.usage(), num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_total_blocks, num_preemptions=sch.num_preemptions,
            prompt_tokens=self.prompt_tokens_total, generation_tokens=self.generation_tokens_total,
            prefix_cache_queries=bm.prefix_queries, prefix_cache_hits=bm.prefix_hits,
            moe_expert_tokens={i: m.expert_tokens.tolist() for i, m in self.runner.moe_blocks})


def prepare_params(params: SamplingParams, vocab_size: int, tokenizer, structured) -> None:
    """Check the token controls against this model's vocabulary, tokenize bad_words and compile the
    constraint (cached) with `structured()`, the model's StructuredOutputManager. Raises ValueError naming the
    problem. Safe to call from any thread, and again. The engine and a replica's front end both use it."""
    vocab = vocab_size
    allowed = params.allowed_token_ids
    if allowed is not None and len(allowed) > vocab:
        raise ValueError(f"allowed_token_ids holds {len(allowed)} ids; this model's vocabulary has {vocab} tokens.")
    unknown = sorted({t for t in (params.logit_bias or {}) if t >= vocab}
                     | {t for t in (params.allowed_token_ids or []) if t >= vocab})
    if unknown:
        name = "logit_bias" if any(t in (params.logit_bias or {}) for t in unknown) else "allowed_token_ids"
        raise ValueError(f"{name} names token ids this model does not have (vocabulary size {vocab}): "
                         f"{unknown[:10]}.")
    if allowed is not None and params._allowed_mask is None:  # once per request, off the engine thread
        params.allowed_token_ids = list(dict.fromkeys(allowed))
        allowed_mask(params, vocab)
    if params.bad_words and not params._bad_words_token_ids:
        words: list[list[int]] = []
        for w in params.bad_words:
            for text in (w.lstrip(), " " + w.lstrip()):
                ids = tokenizer.encode(text, add_special_tokens=False)
                if ids and ids not in words:
                    words.append(ids)
        params._bad_words_token_ids = words
    if params.structured_outputs is not None:
        structured().compile(params.structured_outputs)
