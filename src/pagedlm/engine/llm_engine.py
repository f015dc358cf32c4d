"""The engine loop: schedule -> build the flat batch -> forward -> pool and sample -> account and free
(`Scheduler.update_from_output`) -> outputs. Requests come in checked (`EngineRequest`, input_processor.py) and
leave as `EngineOutput` deltas (protocol.py); the step's pieces live beside it: step.py (the batch and the step's
context), pooling.py (embedding requests' vectors), sample.py (forks, beams, sampling, appending),
output_processor.py (text, stops, outputs)."""
from __future__ import annotations

import gc
import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

import torch

from pagedlm.config import DEFAULT_MODEL, EngineConfig, ModelConfig
from pagedlm.engine.draft_loader import load_draft_weights
from pagedlm.engine.errors import InvalidRequestError
from pagedlm.engine.input_processor import EngineInfo, InputProcessor
from pagedlm.engine.kv_offload import DiskOffload
from pagedlm.engine.model_runner import ModelRunner
from pagedlm.engine.output_processor import OutputProcessor
from pagedlm.engine.pooling import PoolingState, pool_step
from pagedlm.engine.protocol import EngineOutput, EngineRequest
from pagedlm.engine.sample import StepSampler
from pagedlm.engine.scheduler import Scheduler
from pagedlm.engine.sequence import Request, Sequence
from pagedlm.engine.snapshot import BlockMoves
from pagedlm.engine.spec_decode import SpecDecoder, SpecStats
from pagedlm.engine.step import StepContext, build_batch
from pagedlm.hub.hf_config import load_hf_config
from pagedlm.hub.registry import resolve_model
from pagedlm.hub.tokenizer import load_tokenizer
from pagedlm.kvcache.block_manager import BlockManager
from pagedlm.kvcache.disk_tier import DiskTierStats
from pagedlm.kvcache.kv_cache import KVCacheSpec
from pagedlm.kvcache.plan import check_fits, plan_kv_cache
from pagedlm.kvcache.sizing import AvailableMemory, available_memory
from pagedlm.model.plan import ExecutionPlan, estimate_weight_bytes, plan_execution
from pagedlm.model.step_rows import draft_rows
from pagedlm.sampling.beam_search import BeamSearch
from pagedlm.sampling.params import SamplingParams
from pagedlm.sampling.sampler import Sampler
from pagedlm.sampling.structured import MaskPrefetcher, StructuredOutputManager
from pagedlm.sampling.thinking import ThinkingScan

logger = logging.getLogger(__name__)

# Before the weights load, a configuration is refused only where weights of this share of their estimated size
# would leave it no room: the estimate (model/plan.py) may be a little over what the load holds.
EARLY_REFUSAL_WEIGHT_SHARE = 0.9


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
    disk: DiskTierStats | None = None  # the prefix cache's disk tier (--kv-cache-dir)
    moe_expert_tokens: dict[int, list[int]] = field(default_factory=dict)  # MoE layer -> tokens per expert
    spec_decode: SpecStats = field(default_factory=SpecStats)


class LLMEngine:
    """One model's engine: `add_request` / `abort_request` between steps, `step()` for the outputs. Not
    thread-safe: AsyncLLMEngine steps it on a thread of its own; other threads use `input_processor`."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        if torch.device(config.device).type == "cuda" and not torch.cuda.is_available():
            raise ValueError(f"device {config.device!r}: torch sees no CUDA device here (a CPU build, or no GPU).")
        self.model_path = path = resolve_model(config.model)
        self.plan = plan_execution(config, path)
        self.dtype = self.plan.dtype
        logger.info("%s", self.plan.describe())
        self.tokenizer = load_tokenizer(path)
        host_memory = available_memory()  # before the weights load: the KV budget is sized against what they leave
        if torch.device(config.device).type == "cpu":
            _refuse_early(config, path, self.plan, host_memory)
        self.runner = ModelRunner(config, path, self.plan)
        self.model_config = self.runner.model_config
        spec, device = self.runner.kv_spec, self.runner.device
        memory = (AvailableMemory(torch.cuda.mem_get_info(device)[0], "CUDA free") if device.type == "cuda"
                  else host_memory)
        spec_config = config.speculative_config
        self.draft = (load_draft_weights(config, self.tokenizer, self.model_config.vocab_size)
                      if spec_config is not None and spec_config.method == "draft_model" else None)
        kv = plan_kv_cache(config, self.model_config, spec, self.runner.weight_bytes(), memory, device.type,
                           draft=self.draft.sizing if self.draft is not None else None)
        self.kv_budget, self.memory_report, self.max_model_len = kv.budget, kv.report, kv.max_model_len
        self.runner.allocate_kv_cache(kv.num_blocks, kv.num_cpu_blocks)
        self.block_manager = BlockManager(kv.num_blocks, config.block_size, kv.num_cpu_blocks, config.watermark,
                                          config.enable_prefix_caching, spec.sliding_windows)
        self.scheduler = Scheduler(config, self.block_manager)
        drafter = self.draft.start(kv.budget.draft_blocks) if self.draft is not None else None
        self.spec = SpecDecoder(spec_config, self.max_model_len, drafter)
        logger.info("%s", spec_config.describe() if spec_config is not None else
                    "speculative decoding: off (a request with a prediction drafts from it)")
        self.offload = self.scheduler.kv_loader = DiskOffload.create(
            config, path, self.model_config, self.plan, self.block_manager, self.runner.kv_cache)
        self.block_moves = BlockMoves()  # blocks copied and swapped, for the memory views (snapshot.py)
        self.eos_token_ids = set(self.tokenizer.eos_token_ids) | set(self.model_config.eos_token_ids)
        self.input_processor = InputProcessor(EngineInfo.of(self), self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer, self.eos_token_ids, self.max_model_len)
        self.masks = MaskPrefetcher(self.input_processor.structured)
        self.step_sampler = StepSampler(self.scheduler, Sampler(self.eos_token_ids, seed=config.seed),
                                        self.output_processor, self.masks, self._new_seq)
        self._requests: dict[str, Request] = {}
        logger.info("%s", self.memory_report.format())
        if self.offload is not None:
            logger.info("%s", self.offload.tier.describe())
        elif config.kv_cache_dir is not None:
            logger.info("KV disk tier: off (it needs the prefix cache, which is off).")
        # What start-up built (tokenizer tables, model, plan) lives as long as the engine: out of the cyclic
        # collector's way, whose passes over it cost ~10% of a short step (as vLLM's engine core does).
        gc.collect()
        gc.freeze()

    @classmethod
    def from_args(cls, model: str = DEFAULT_MODEL, **kwargs) -> LLMEngine:
        known = {f.name for f in fields(EngineConfig)}
        unknown = set(kwargs) - known
        if unknown:
            raise TypeError(f"Unknown engine arguments: {sorted(unknown)}")
        return cls(EngineConfig(model=model, **kwargs))

    @property
    def structured(self) -> StructuredOutputManager:
        """The constrained-decoding compiler (built on first use: wrapping the vocabulary takes about a second)."""
        return self.input_processor.structured()

    @property
    def sampler(self) -> Sampler:
        return self.step_sampler.sampler

    @property
    def mask_seconds_total(self) -> float:
        """Time spent computing grammar masks."""
        return self.masks.seconds

    # --- requests ------------------------------------------------------------------------------------------
    def add_request(self, request: EngineRequest | str, prompt: str | list[int] | None = None,
                    params: SamplingParams | None = None, arrival_time: float | None = None, priority: int = 0,
                    cache_salt: str | None = None) -> None:
        """Queue an EngineRequest (checked by the InputProcessor), or check and queue (request id, prompt, params,
        ...). Raises InvalidRequestError (a ValueError; nothing queued) on bad input."""
        if not isinstance(request, EngineRequest):
            request = self.input_processor.process(request, prompt, params, arrival_time, priority, cache_salt)
        if request.request_id in self._requests:
            raise InvalidRequestError(f"Request id {request.request_id!r} is already in use.", "request_id")
        params = request.params
        req = Request(request.request_id, request.prompt, request.prompt_token_ids, params, request.arrival_time,
                      request.priority, cache_salt=request.cache_salt)
        if request.pooling is not None:
            req.pooler = PoolingState(request.pooling)
        if params.use_beam_search:
            max_tokens = min(params.max_tokens, self.max_model_len - len(req.prompt_token_ids))
            req.beam = BeamSearch(params.beam_width, params.length_penalty, params.early_stopping, max_tokens,
                                  set() if params.ignore_eos else set(self.eos_token_ids))
        req.seqs.append(self._new_seq(req, 0))
        self._requests[req.request_id] = req
        self.scheduler.add_request(req)

    def _new_seq(self, req: Request, index: int) -> Sequence:
        gen = None
        if req.params.seed is not None:
            gen = torch.Generator(device=self.runner.device)
            gen.manual_seed(req.params.seed + index)
        seq = Sequence(list(req.prompt_token_ids), index=index, generator=gen, cache_salt=req.cache_salt)
        seq.detokenizer = self.output_processor.detokenizer(req)
        seq.spec = self.spec.state_for(req)
        if req.params.thinking_token_budget is not None:
            seq.thinking = ThinkingScan()
        return seq

    def abort_request(self, request_id: str | Iterable[str]) -> None:
        for rid in [request_id] if isinstance(request_id, str) else list(request_id):
            self.abort_output(rid)

    def abort_output(self, request_id: str) -> EngineOutput | None:
        """Abort the request and return its last output (finish_reason 'abort'), or None if it is unknown."""
        req = self.scheduler.abort_request(request_id)
        if req is None:
            return None
        self._requests.pop(request_id, None)
        self.spec.retain(self.scheduler.running)
        return self.output_processor.make_output(req, True)

    def close(self) -> None:
        """Finish the disk tier's queued writes and stop its threads (the engine's KV stays usable in memory)."""
        if self.offload is not None:
            self.offload.close()
            self.offload = self.scheduler.kv_loader = None
            self.scheduler.waiting.extendleft(reversed(self.scheduler.loading))  # their blocks are computed
            self.scheduler.loading.clear()

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def get_num_unfinished_requests(self) -> int:
        return len(self._requests)

    # --- the step ----------------------------------------------------------------------------------------------
    def step(self) -> list[EngineOutput]:
        """Run one step; the outputs of the requests it advanced, finished or failed."""
        self.spec.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        self.spec.retain(self.scheduler.running)  # preempted sequences give their draft K/V up
        self.block_moves.record(sched)
        try:
            kv = self.runner.kv_cache
            kv.swap_out(sched.blocks_to_swap_out)
            kv.swap_in(sched.blocks_to_swap_in)
            kv.copy_blocks(sched.blocks_to_copy)
            if sched.is_empty:
                if self.offload is not None and self.offload.loads:
                    self.offload.wait(0.05)  # nothing runs until a prefix is read
                return []
            ctx = StepContext(sched, build_batch(sched, self.block_manager))
            self.step_sampler.start_masks(ctx)  # on a worker thread, while the forward pass runs
            t0 = time.perf_counter()
            hidden = None
            try:
                # verify rows choose the kernel or GEMM path as the step without its drafts would
                with draft_rows(sum(s.num_draft_tokens for s in sched.scheduled)):
                    if ctx.batch.hidden_index:
                        logits, hidden = self.runner.execute_with_hidden(ctx.batch.chunks, ctx.batch.logits_index,
                                                                         ctx.batch.hidden_index)
                    else:
                        logits = self.runner.execute(ctx.batch.chunks, ctx.batch.logits_index)
            finally:  # the matchers are the engine thread's again (forks copy them)
                if ctx.masks is not None:
                    ctx.masks.wait()
            if self.offload is not None:
                self.offload.observe_step(sched.num_batched_tokens, time.perf_counter() - t0)
                self.offload.after_forward(sched.scheduled)
        except BaseException:
            self.scheduler.step_failed(sched)  # its blocks' hashes were registered before their KV was written
            raise
        ctx.now = time.monotonic()
        try:
            pool_step(ctx, hidden, self.step_sampler.fail)
            self.step_sampler.sample(ctx, logits)
        finally:
            self.scheduler.update_from_output(sched, ctx.finished, ctx.num_generated_tokens)
            self.spec.count(sched, ctx.finished)
            self.spec.retain(self.scheduler.running)
        return self._outputs(ctx)

    def _outputs(self, ctx: StepContext) -> list[EngineOutput]:
        outputs = []
        now = time.monotonic()
        for rid, req in ctx.touched.items():
            if rid in ctx.failed:
                continue
            done = req.finished
            if done:
                req.metrics.finished_time = now
                self._requests.pop(rid, None)
            out = self.output_processor.make_output(req, done)
            if out is not None:
                outputs.append(out)
        for rid, (req, error) in ctx.failed.items():
            req.metrics.finished_time = now
            self._requests.pop(rid, None)
            outputs.append(self.output_processor.make_output(req, True, error))
        return outputs

    def get_stats(self) -> EngineStats:
        sch = self.scheduler
        bm = self.block_manager
        return EngineStats(
            num_running=sum(len(r.live_seqs) for r in sch.running), num_waiting=len(sch.waiting) + len(sch.loading),
            num_swapped=len(sch.swapped), kv_cache_usage=bm.usage(), num_free_blocks=bm.num_free_blocks,
            num_total_blocks=bm.num_total_blocks, num_preemptions=sch.num_preemptions,
            prompt_tokens=sch.num_prompt_tokens, generation_tokens=sch.num_generation_tokens,
            prefix_cache_queries=bm.prefix_queries, prefix_cache_hits=bm.prefix_hits,
            moe_expert_tokens={i: m.expert_tokens.tolist() for i, m in self.runner.moe_blocks},
            disk=replace(self.offload.tier.stats) if self.offload is not None else None,
            spec_decode=replace(self.spec.stats, accepted_per_pos=list(self.spec.stats.accepted_per_pos)))


def _refuse_early(config: EngineConfig, path: Path, plan: ExecutionPlan, memory: AvailableMemory) -> None:
    """A KV cache this machine cannot hold next to the weights, refused before they load (kvcache/plan.py
    `check_fits`), with the estimate's figures in the message."""
    model = ModelConfig.from_hf(load_hf_config(path))
    spec = KVCacheSpec.for_model(model, config.block_size, plan.dtype, plan.kv_cache_dtype)
    estimate = estimate_weight_bytes(path, plan)
    try:
        check_fits(config, model, spec, int(EARLY_REFUSAL_WEIGHT_SHARE * estimate), memory)
    except ValueError:
        check_fits(config, model, spec, estimate, memory)  # refused too (more weights leave less room): its figures
        raise
