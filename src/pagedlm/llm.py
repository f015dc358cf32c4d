"""Offline inference, vLLM-shaped: `LLM(model=...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import asyncio
import itertools
import threading
import time
from typing import Any
from typing import Sequence as Seq

from tqdm import tqdm

from pagedlm.config import DEFAULT_MODEL, EngineConfig, LoopConfig, ParallelConfig
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.engine.protocol import OutputAccumulator
from pagedlm.outputs import RequestOutput
from pagedlm.sampling.params import SamplingParams

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    """data_parallel_size > 1: that many engine replicas (Ray actors, each on its share of the cores; `ray_address`
    joins a cluster, else a local Ray is started), over which `generate` spreads its prompts (`replica_policy`);
    `shutdown()` stops them."""

    def __init__(self, model: str = DEFAULT_MODEL, dtype: str = "auto", data_parallel_size: int = 1,
                 ray_address: str | None = None, replica_policy: str = "prefix", **engine_args: Any) -> None:
        self._ids = itertools.count()
        self.replicas = None
        parallel = ParallelConfig(data_parallel_size, ray_address, replica_policy)
        if parallel.replicated:
            from pagedlm.dp.launch import launch_replica_set

            config = EngineConfig(model=model, dtype=dtype, **engine_args)  # bad arguments fail here, not in an actor
            self.replicas = launch_replica_set(config, parallel, LoopConfig.offline(log_interval=0))
            self.engine = self.replicas
            self._loop = asyncio.new_event_loop()
            threading.Thread(target=self._loop.run_forever, name="pagedlm-llm", daemon=True).start()
        else:
            self.engine = LLMEngine.from_args(model=model, dtype=dtype, **engine_args)

    def shutdown(self) -> None:
        """Stop the replicas (data parallel); a single engine needs nothing."""
        if self.replicas is not None:
            self.replicas.shutdown()
            self._loop.call_soon_threadsafe(self._loop.stop)
            self.replicas = None

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: Prompt | Seq[Prompt],
                 sampling_params: SamplingParams | Seq[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Seq[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in the order of `prompts`."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, (list, tuple)):
            params = list(sampling_params)
        else:
            params = [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"Got {len(params)} sampling params for {len(prompts)} prompts.")
        for p in params:
            p.validate()
        if self.replicas is not None:
            return asyncio.run_coroutine_threadsafe(self._generate_dp(prompts, params, priority, use_tqdm),
                                                    self._loop).result()
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                rid = str(next(self._ids))
                self.engine.add_request(rid, prompt, p, priority=priority[i] if priority else 0)
                ids.append(rid)
            return self._run(ids, use_tqdm)
        except BaseException:
            self.engine.abort_request(ids)
            raise

    def chat(self, messages: list[Message] | list[list[Message]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             continue_final_message: bool = False) -> list[RequestOutput]:
        """Each conversation rendered as the server renders a chat request (`render_chat`), then generated
        (`continue_final_message`: the last message continued, as vLLM's)."""
        from pagedlm.engine.chat import render_chat

        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = [tok.encode(render_chat(tok, c, add_generation_prompt, continue_final_message=continue_final_message),
                              add_special_tokens=False) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    async def _generate_dp(self, prompts: list[Prompt], params: list[SamplingParams], priority: Seq[int] | None,
                           use_tqdm: bool) -> list[RequestOutput]:
        streams = []
        bar = tqdm(total=len(prompts), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        try:
            processor = self.replicas.input_processor
            for i, (prompt, p) in enumerate(zip(prompts, params)):
                request = processor.process(str(next(self._ids)), prompt, p, priority=priority[i] if priority else 0)
                streams.append(self.replicas.submit(request))
            await asyncio.gather(*(s.accepted() for s in streams))

            async def final(stream) -> RequestOutput:
                out = await stream.result()  # nothing is shown before the end: a lost replica's requests are retried
                bar.update(1)
                return out

            return list(await asyncio.gather(*(final(s) for s in streams)))
        finally:
            bar.close()
            for s in streams:
                s.abort()

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        accumulators = {rid: OutputAccumulator(rid) for rid in ids}
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        start = time.perf_counter()
        in_tok = out_tok = 0
        while self.engine.has_unfinished_requests():
            for delta in self.engine.step():
                acc = accumulators[delta.request_id]
                acc.add(delta)
                if delta.finished:
                    done[delta.request_id] = out = acc.output()
                    in_tok += len(out.prompt_token_ids)
                    out_tok += sum(len(o.token_ids) for o in out.outputs)
                    elapsed = time.perf_counter() - start
                    bar.set_postfix_str(f"input: {in_tok / elapsed:.1f} toks/s, output: {out_tok / elapsed:.1f} toks/s")
                    bar.update(1)
        bar.close()
        return [done[i] for i in ids]
