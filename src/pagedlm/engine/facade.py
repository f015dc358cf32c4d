"""What the layers above may know of an engine: `EngineInfo` (its static facts, picklable, so that a replica can
send them) and `EngineFacade` (those facts with the tokenizer, and the checks a front end runs before it hands a
request over). Both are built once, on the engine's side, and never change; every method is safe to call from
any thread while the engine runs.

The server and a replica set's front end see an engine only through its facade and the public methods of
`AsyncLLMEngine` (submit / abort / stats / listeners); `LLM.chat` renders its prompts with the same
`render_chat`, so the chat template is applied in one place.
"""
from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedlm.engine.admission import AdmissionLimits, KVCacheShape, check_admission
from pagedlm.engine.llm_engine import prepare_params
from pagedlm.sampling.params import MAX_JSON_DEPTH, JSONDepthError, SamplingParams, loads_json, within_depth

if TYPE_CHECKING:
    from pagedlm.engine.llm_engine import LLMEngine
    from pagedlm.hub.tokenizer import Tokenizer
    from pagedlm.sampling.structured import StructuredOutputManager


class ChatTemplateError(ValueError):
    """The model has no chat template, or its template rejected the messages."""

    param = "messages"


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
    kv: KVCacheShape
    prefix_caching: bool
    family: str = ""  # the model's architecture (HF model_type)
    num_parameters: int = 0  # of the checkpoint
    weights: str = ""  # the served weights' format: int4, int8, bf16, or the dtype of dense ones

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineInfo:
        cfg, bm, mc = engine.config, engine.block_manager, engine.model_config
        return cls(model=cfg.model, model_path=Path(engine.model_path), max_model_len=engine.max_model_len,
                   max_num_seqs=cfg.max_num_seqs, max_logprobs=cfg.max_logprobs,
                   max_stop_sequences=cfg.max_stop_sequences, max_stop_length=cfg.max_stop_length,
                   eos_token_ids=frozenset(engine.eos_token_ids), vocab_size=mc.vocab_size,
                   kv=KVCacheShape.of(bm, cfg.max_num_batched_tokens),
                   prefix_caching=bm.enable_prefix_caching, family=mc.model_type,
                   num_parameters=mc.num_parameters(),
                   weights=engine.plan.quantization or str(engine.plan.dtype).removeprefix("torch."))

    @property
    def admission(self) -> AdmissionLimits:
        return AdmissionLimits(self.max_model_len, self.max_num_seqs, self.kv)


@dataclass(frozen=True)
class EngineFacade:
    """An engine's facts, its tokenizer, and the front-end checks: `render_chat`, `check_admission`,
    `prepare_params`. `structured()` returns the engine's constrained-decoding compiler (built on first use)."""

    info: EngineInfo
    tokenizer: Tokenizer
    structured: Callable[[], StructuredOutputManager] = field(repr=False, compare=False)

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineFacade:
        """The facade of a local engine (its compiler is the engine's own: compiled constraints are cached)."""
        return cls(EngineInfo.of(engine), engine.tokenizer, lambda: engine.structured)

    @classmethod
    def remote(cls, info: EngineInfo, tokenizer: Tokenizer) -> EngineFacade:
        """The facade of an engine in another process (a replica): the checks run here, with a compiler of this
        process, so that bad requests are refused before they cross."""
        return cls(info, tokenizer, _LazyStructured(info, tokenizer))

    # --- facts ---
    @property
    def model_path(self) -> Path:
        return self.info.model_path

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.info.eos_token_ids

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    # --- checks ---
    def render_chat(self, messages: list[Mapping[str, Any]], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None, chat_template: str | None = None,
                    template_kwargs: Mapping[str, Any] | None = None) -> str:
        """The prompt text of a conversation (OpenAI-shaped messages: role, content, and optionally name,
        tool_call_id, tool_calls). Assistant tool calls are rendered by the template where it knows them (its
        `tool_calls`), else as Hermes-style text in the turn's content. `chat_template` replaces the model's
        own for this call; `template_kwargs` are more template variables (e.g. enable_thinking). Raises
        ChatTemplateError."""
        return render_chat(self.tokenizer, messages, add_generation_prompt, tools, chat_template, template_kwargs)

    def check_admission(self, prompt_lens: Iterable[int], params: SamplingParams) -> None:
        """Raise AdmissionError (param, code) unless each prompt could run to its end alone (admission.py)."""
        check_admission(prompt_lens, params, self.info.admission)

    def prepare_params(self, params: SamplingParams) -> None:
        """Check the token controls against the vocabulary, tokenize bad_words and compile the constraint
        (cached); raises ValueError naming the problem. Thread-safe, and what the engine does again."""
        prepare_params(params, self.info.vocab_size, self.tokenizer, self.structured)


def render_chat(tokenizer: Tokenizer, messages: list[Mapping[str, Any]], add_generation_prompt: bool = True,
                tools: list[dict] | None = None, chat_template: str | None = None,
                template_kwargs: Mapping[str, Any] | None = None) -> str:
    """`EngineFacade.render_chat` for a bare tokenizer (the one place the chat template is applied)."""
    knows_calls = "tool_calls" in (chat_template or tokenizer.hf.chat_template or "")
    msgs = [_template_message(m, knows_calls) for m in messages]
    try:
        return tokenizer.apply_chat_template(msgs, add_generation_prompt=add_generation_prompt, tools=tools,
                                             chat_template=chat_template, **(template_kwargs or {}))
    except Exception as e:  # noqa: BLE001 - no template, or the template rejected the messages
        raise ChatTemplateError(f"Cannot apply the chat template: {e}") from None


def _template_message(m: Mapping[str, Any], knows_calls: bool) -> dict[str, Any]:
    msg = dict(m)
    calls = msg.pop("tool_calls", None)
    if not calls:
        return msg
    calls = [{"id": c.get("id"), "type": "function",
              "function": {"name": c["function"]["name"], "arguments": _json_arguments(c["function"]["arguments"])}}
             for c in calls]
    if knows_calls:
        msg["tool_calls"] = calls
    else:
        msg["content"] = (msg.get("content") or "") + "".join(
            f'\n<tool_call>\n{{"name": {json.dumps(c["function"]["name"])}, "arguments": '
            f'{json.dumps(c["function"]["arguments"])}}}\n</tool_call>' for c in calls)
    return msg


def _json_arguments(arguments: str | dict) -> dict | str:
    """A tool call's arguments as an object (templates write it with tojson), or the text if it is not JSON.
    ChatTemplateError if they are nested more than MAX_JSON_DEPTH levels deep."""
    name = "tool_calls[].function.arguments"
    try:
        if isinstance(arguments, dict):
            if not within_depth(arguments):
                raise JSONDepthError(f"{name} is nested more than {MAX_JSON_DEPTH} levels deep.")
            return arguments
        value = loads_json(arguments, name)
    except JSONDepthError as e:
        raise ChatTemplateError(str(e)) from None
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments


class _LazyStructured:
    """A StructuredOutputManager for `info`'s vocabulary, built on first use (wrapping it takes about a second)."""

    def __init__(self, info: EngineInfo, tokenizer: Tokenizer) -> None:
        self.info, self.tokenizer = info, tokenizer
        self._manager: StructuredOutputManager | None = None
        self._lock = threading.Lock()

    def __call__(self) -> StructuredOutputManager:
        with self._lock:
            if self._manager is None:
                from pagedlm.sampling.structured import StructuredOutputManager
                self._manager = StructuredOutputManager(self.tokenizer.hf, self.info.vocab_size,
                                                        set(self.info.eos_token_ids))
            return self._manager
