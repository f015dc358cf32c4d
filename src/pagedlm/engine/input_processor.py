"""Input processing: a request checked once and turned into an `EngineRequest` (vLLM's InputProcessor).

`InputProcessor` is the one object the server, `LLM` and the engine share: the engine's static facts
(`EngineInfo`), its tokenizer and constraint compiler, and every check a request meets before it is queued (the
engine's limits, the token controls against the vocabulary, the prompt against the context, admission). The
server runs them on a worker thread and submits what they built; `LLMEngine.add_request` runs them for the
offline API; the engine thread only checks what depends on its state (a unique id, room in the waiting queue).
Every method is safe to call from any thread while the engine runs. A replica's front end builds its own from
the replica's `EngineInfo` (`EngineInfo` is picklable), so bad requests are refused before they cross.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedlm.engine.admission import AdmissionLimits, KVCacheShape, check_admission
from pagedlm.engine.chat import render_chat
from pagedlm.engine.errors import AdmissionError, ContextLengthError, InvalidRequestError
from pagedlm.engine.protocol import EngineRequest, PoolingParams
from pagedlm.sampling.params import SamplingParams
from pagedlm.sampling.sampler import allowed_mask
from pagedlm.sampling.structured import StructuredOutputManager

if TYPE_CHECKING:
    from pagedlm.engine.llm_engine import LLMEngine
    from pagedlm.hub.tokenizer import Tokenizer


@dataclass(frozen=True)
class EngineInfo:
    """An engine's static facts: its model, context length, request limits and KV cache shape."""

    model: str  # as configured (a registry name or a path)
    model_path: Path
    max_model_len: int
    max_num_seqs: int
    max_logprobs: int
    max_stop_sequences: int
    max_stop_length: int
    eos_token_ids: frozenset[int]
    vocab_size: int  # the model's (logits) vocabulary
    kv: KVCacheShape  # its max_chunk is max_num_batched_tokens
    prefix_caching: bool
    family: str = ""  # the model's architecture (HF model_type)
    num_parameters: int = 0  # of the checkpoint
    weights: str = ""  # the served weights' format: int4, int8, bf16, or the dtype of dense ones
    hidden_size: int = 0  # the model's hidden states' width: its embeddings' (pooling requests')
    file_type: str = ""  # a GGUF's type as llama.cpp names it (Q4_K_M, Q8_0, F16); empty for other checkpoints
    metadata: Mapping[str, Any] = field(default_factory=dict, compare=False)  # a GGUF's, but its arrays

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineInfo:
        cfg, bm, mc = engine.config, engine.block_manager, engine.model_config
        return cls(model=cfg.model, model_path=Path(engine.model_path), max_model_len=engine.max_model_len,
                   max_num_seqs=cfg.max_num_seqs, max_logprobs=cfg.max_logprobs,
                   max_stop_sequences=cfg.max_stop_sequences, max_stop_length=cfg.max_stop_length,
                   eos_token_ids=frozenset(engine.eos_token_ids), vocab_size=mc.vocab_size,
                   kv=KVCacheShape.of(bm, cfg.max_num_batched_tokens), prefix_caching=bm.enable_prefix_caching,
                   family=mc.model_type, num_parameters=mc.num_parameters(),
                   weights=engine.plan.quantization or str(engine.plan.dtype).removeprefix("torch."),
                   hidden_size=mc.hidden_size, **_gguf_facts(Path(engine.model_path)))

    @property
    def admission(self) -> AdmissionLimits:
        return AdmissionLimits(self.max_model_len, self.max_num_seqs, self.kv)


def _gguf_facts(path: Path) -> dict[str, Any]:
    if path.suffix != ".gguf" or not path.is_file():
        return {}
    from pagedlm.hub.registry import open_gguf

    header = open_gguf(path)
    return {"file_type": header.file_type, "metadata": header.scalars}


class InputProcessor:
    """`info`'s engine as a front end sees it: its tokenizer, the chat template, the constraint compiler
    (`structured()`, built on first use) and the checks. Each check raises an InvalidRequestError subclass naming
    the request field (`param`)."""

    def __init__(self, info: EngineInfo, tokenizer: Tokenizer) -> None:
        self.info, self.tokenizer = info, tokenizer
        self._structured: StructuredOutputManager | None = None
        self._lock = threading.Lock()

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def model_path(self) -> Path:
        return self.info.model_path

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.info.eos_token_ids

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    def structured(self) -> StructuredOutputManager:
        """The constrained-decoding compiler for this vocabulary (built on first use: about a second)."""
        with self._lock:
            if self._structured is None:
                self._structured = StructuredOutputManager(self.tokenizer.hf, self.info.vocab_size,
                                                           set(self.info.eos_token_ids))
            return self._structured

    def render_chat(self, messages: list[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, chat_template: str | None = None,
                    template_kwargs: Mapping[str, Any] | None = None, continue_final_message: bool = False) -> str:
        """chat.render_chat with this model's template (or `chat_template` for this call); raises
        ChatTemplateError."""
        return render_chat(self.tokenizer, messages, add_generation_prompt, tools, chat_template, template_kwargs,
                           continue_final_message)

    # --- the checks --------------------------------------------------------------------------------------
    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        """(the text, if the prompt is text; its token ids)."""
        if isinstance(prompt, str):
            return prompt, self.tokenizer.encode(prompt)
        return None, list(prompt)

    def check_prompt(self, token_ids: list[int], param: str = "prompt", generates: bool = True) -> None:
        """Token ids within the vocabulary, not empty, and short enough to leave a generated token room (unless
        nothing is generated: an embedding input may fill the context); errors name `param`."""
        vocab = self.info.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in token_ids):
            raise InvalidRequestError(f"Prompt token ids must be integers in [0, {vocab}).", param)
        if not token_ids:
            raise InvalidRequestError("The prompt is empty.", param)
        if len(token_ids) >= self.info.max_model_len + (not generates):
            room = ", including at least one generated token" if generates else ""
            raise ContextLengthError(f"The prompt has {len(token_ids)} tokens; this model's maximum context length "
                                     f"is {self.info.max_model_len} tokens{room}.", param)

    def check_params(self, params: SamplingParams, prompt_lens: Iterable[int]) -> None:
        """The params on their own, against the engine's limits, and (with prompts of these lengths) against
        what the engine could ever finish (admission.py)."""
        try:
            params.validate()
        except InvalidRequestError:
            raise
        except ValueError as e:
            raise InvalidRequestError(str(e), getattr(e, "param", None)) from None
        info = self.info
        for name in ("logprobs", "prompt_logprobs"):
            k = getattr(params, name)
            if k is not None and k > info.max_logprobs:
                raise InvalidRequestError(f"{name} {k} exceeds this engine's max_logprobs ({info.max_logprobs}).",
                                          name)
        for name in ("stop", "stop_token_ids"):
            if len(getattr(params, name)) > info.max_stop_sequences:
                raise InvalidRequestError(f"{name} holds {len(getattr(params, name))} entries; at most "
                                          f"{info.max_stop_sequences} are allowed (max_stop_sequences).", name)
        if any(len(stop) > info.max_stop_length for stop in params.stop):
            raise InvalidRequestError(f"A stop string is longer than max_stop_length ({info.max_stop_length} "
                                      "characters).", "stop")
        self.check_admission(prompt_lens, params)
        most_beams = min(info.max_num_seqs, info.kv.max_chunk or info.max_num_seqs)
        if params.use_beam_search and params.beam_width > most_beams:
            raise InvalidRequestError(f"beam_width {params.beam_width} exceeds max_num_seqs / "
                                      "max_num_batched_tokens.", "beam_width")

    def check_admission(self, prompt_lens: Iterable[int], params: SamplingParams) -> None:
        """AdmissionError unless each prompt could run to its end alone (admission.py)."""
        check_admission(prompt_lens, params, self.info.admission)

    def prepare_params(self, params: SamplingParams) -> None:
        """The token controls checked against the vocabulary, bad_words tokenized and the constraint compiled
        (cached): once per request, off the engine thread. Safe to call again."""
        prepare_params(params, self.info.vocab_size, self.tokenizer, self.structured)

    def pooling_request(self, request_id: str, token_ids: list[int], pooling: PoolingParams,
                        arrival_time: float | None = None, priority: int = 0, cache_salt: str | None = None,
                        param: str = "input") -> EngineRequest:
        """An embedding input's checks (the vocabulary, the context, admission), then its EngineRequest: the
        prompt's final hidden states pooled (engine/pooling.py), nothing generated."""
        self.check_prompt(token_ids, param, generates=False)
        params = SamplingParams(max_tokens=0)
        try:
            self.check_admission([len(token_ids)], params)
        except AdmissionError:
            raise AdmissionError(f"An input of {len(token_ids)} tokens does not fit in this engine's KV cache (one "
                                 f"sequence fits at most {self.info.kv.max_tokens_per_seq()} tokens).",
                                 param) from None
        return EngineRequest(request_id, token_ids, params, None,
                             time.monotonic() if arrival_time is None else arrival_time, priority, cache_salt,
                             pooling)

    def process(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                arrival_time: float | None = None, priority: int = 0,
                cache_salt: str | None = None) -> EngineRequest:
        """Every check, then the EngineRequest the engine queues as it is."""
        params = params or SamplingParams()
        text, token_ids = self.tokenize(prompt)
        self.check_prompt(token_ids)
        self.check_params(params, [len(token_ids)])
        self.prepare_params(params)
        return EngineRequest(request_id, token_ids, params, text,
                             time.monotonic() if arrival_time is None else arrival_time, priority, cache_salt)


def prepare_params(params: SamplingParams, vocab_size: int, tokenizer: Tokenizer, structured) -> None:
    """`InputProcessor.prepare_params` with the vocabulary size, tokenizer and `structured()` (the compiler)
    given."""
    vocab = vocab_size
    allowed = params.allowed_token_ids
    if allowed is not None and len(allowed) > vocab:
        raise InvalidRequestError(f"allowed_token_ids holds {len(allowed)} ids; this model's vocabulary has {vocab} "
                                  "tokens.", "allowed_token_ids")
    unknown = sorted({t for t in (params.logit_bias or {}) if t >= vocab}
                     | {t for t in (params.allowed_token_ids or []) if t >= vocab})
    if unknown:
        name = "logit_bias" if any(t in (params.logit_bias or {}) for t in unknown) else "allowed_token_ids"
        raise InvalidRequestError(f"{name} names token ids this model does not have (vocabulary size {vocab}): "
                                  f"{unknown[:10]}.", name)
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
    tags = params.reasoning_tags
    if params.thinking_token_budget is not None and tags is not None and not params._thinking_end_ids:
        params._thinking_start_ids = tokenizer.encode(tags.start, add_special_tokens=False)
        params._thinking_end_ids = tokenizer.encode(tags.end, add_special_tokens=False)
    if params.prediction and not params._prediction_token_ids:
        ids = (tokenizer.encode(params.prediction, add_special_tokens=False) if isinstance(params.prediction, str)
               else list(params.prediction))
        if any(t >= vocab for t in ids):
            raise InvalidRequestError(f"prediction holds token ids this model does not have (vocabulary size "
                                      f"{vocab}).", "prediction")
        params._prediction_token_ids = ids
    if params.structured_outputs is not None and params._grammar is None:  # kept for the request's life
        try:
            params._grammar = structured().compile(params.structured_outputs)
        except ValueError as e:
            raise InvalidRequestError(str(e), "structured_outputs") from None
