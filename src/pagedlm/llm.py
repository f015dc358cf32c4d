"""Offline inference, vLLM-shaped: `LLM(model=...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

import itertools
import time
from typing import Any
from typing import Sequence as Seq

from tqdm import tqdm

from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.outputs import RequestOutput
from pagedlm.sampling.params import SamplingParams

Prompt = str | list[int]
Message = dict[str, Any]


class LLM:
    def __init__(self, model: str = "smollm2-135m", dtype: str = "auto", **engine_args: Any) -> None:
        self.engine = LLMEngine.from_args(model=model, dtype=dtype, **engine_args)
        self._ids = itertools.count()

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
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = [tok.encode(tok.apply_chat_template(c, add_generation_prompt=add_generation_prompt),
                              add_special_tokens=False) for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        done: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="Processed prompts", dynamic_ncols=True, disable=not use_tqdm)
        start = time.perf_counter()
        in_tok = out_tok = 0
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                if out.finished:
                    done[out.request_id] = out
                    in_tok += len(out.prompt_token_ids)
                    out_tok += sum(len(o.token_ids) for o in out.outputs)
                    elapsed = time.perf_counter() - start
                    bar.set_postfix_str(f"input: {in_tok / elapsed:.1f} toks/s, output: {out_tok / elapsed:.1f} toks/s")
                    bar.update(1)
        bar.close()
        return [done[i] for i in ids]
