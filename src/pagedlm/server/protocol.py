"""OpenAI request schemas (plus vLLM's extensions), as pydantic models.

Requests are parsed strictly (a field of the wrong type is an error, NaN/inf are rejected; a number with no
fraction, 16.0, is the integer it is: JSON and its schemas do not tell them apart); fields we
do not know are let through (clients sending newer OpenAI fields keep working), and the server names them in the
`x-pagedlm-unknown-fields` response header, or refuses them with --strict-request-fields.
"""
from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, PrivateAttr

from pagedlm.sampling.params import MAX_LOGIT_BIAS_ENTRIES, SamplingParams, StructuredOutputsParams
from pagedlm.sampling.thinking import ReasoningTags
from pagedlm.server.api_errors import RETRY_AFTER_S, APIError, Unavailable, shutting_down  # noqa: F401 - re-exported
from pagedlm.server.prediction import Prediction
from pagedlm.server.response_models import (  # noqa: F401 - the response bodies, re-exported
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionResponse,
    ChatLogprob,
    ChatLogprobs,
    ChatStreamChoice,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    DetokenizeResponse,
    FunctionCall,
    ModelCard,
    ModelList,
    PromptLogprob,
    Response,
    TokenizeResponse,
    ToolCall,
    TopLogprob,
    UsageInfo,
)

_INT64 = 2**63 - 1
MAX_N = 128


class Request(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


def _whole(value: Any) -> Any:
    return int(value) if isinstance(value, float) and value.is_integer() else value


# A request's integer: 16 or 16.0, not 16.5, "16" or true. Bounds go before WHOLE, so that its JSON schema keeps
# them: `Annotated[int, Field(ge=1), WHOLE]`.
WHOLE = BeforeValidator(_whole)
Int = Annotated[int, WHOLE]


# --- requests ---------------------------------------------------------------------------------------------
class StreamOptions(Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(Request):
    name: str = Field("response", max_length=256)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(Request):
    """vLLM's `structured_outputs` object: exactly one of json, regex, choice, grammar, json_object."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_fallback: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    structural_tag: str | None = None


class SamplingRequest(Request):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    n: Annotated[int, Field(ge=1, le=MAX_N), WHOLE] = 1
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=-_INT64 - 1, le=_INT64 - MAX_N), WHOLE] | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # vLLM extensions
    top_k: Int | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    min_tokens: Annotated[int, Field(ge=0), WHOLE] = 0
    ignore_eos: bool = False
    stop_token_ids: list[Int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: Int = 0
    use_beam_search: bool = False
    beam_width: Annotated[int, Field(ge=1, le=MAX_N), WHOLE] | None = None
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    cache_salt: str | None = Field(None, min_length=1, max_length=256)  # a separate prefix cache (vLLM)
    allowed_token_ids: list[Int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: Annotated[int, Field(ge=0), WHOLE] | None = None  # at most the engine's max_logprobs
    # structured outputs: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None
    prediction: Prediction | None = None  # OpenAI's Predicted Outputs (server/prediction.py)

    def check_supported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true.", param="stream_options")
        if self.stream and self.prompt_logprobs is not None:
            raise APIError(400, "prompt_logprobs are not streamed (as in vLLM): ask for them without stream.",
                           param="prompt_logprobs")
        self.token_logit_bias()
        self.structured_outputs_params()

    def token_logit_bias(self) -> dict[int, float] | None:
        """`logit_bias` with its keys (token ids as strings, as OpenAI sends them) as integers."""
        if not self.logit_bias:
            return None
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise APIError(400, f"logit_bias holds {len(self.logit_bias)} entries; at most "
                                f"{MAX_LOGIT_BIAS_ENTRIES} are allowed.", param="logit_bias")
        out = {}
        for key, value in self.logit_bias.items():
            if not (key.isascii() and key.isdigit()) or len(key) > 12:
                raise APIError(400, f"logit_bias keys must be token ids, got {key!r}.", param="logit_bias")
            out[int(key)] = value
        return out

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The one output constraint the request asks for (None: free text); 400 for several or a bad one."""
        found: list[tuple[str, dict[str, Any]]] = []
        rf = self.response_format
        if rf is not None and rf.type == "json_object":
            found.append(("response_format", {"json_object": True}))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise APIError(400, "response_format json_schema needs json_schema.schema.", param="response_format")
            found.append(("response_format", {"json": rf.json_schema.schema_}))
        so = self.structured_outputs
        if so is not None:
            if so.structural_tag is not None:
                raise APIError(400, "structured_outputs.structural_tag is not supported.", param="structured_outputs")
            found.append(("structured_outputs", {"json": so.json_, "regex": so.regex, "choice": so.choice,
                                                 "grammar": so.grammar, "json_object": so.json_object}))
        for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
            if getattr(self, name) is not None:
                found.append((name, {name.removeprefix("guided_"): getattr(self, name)}))
        if not found:
            return None
        if len(found) > 1:
            raise APIError(400, f"Give one output constraint, not {', '.join(n for n, _ in found)}.",
                           param=found[1][0])
        name, spec = found[0]
        if self.use_beam_search:
            raise APIError(400, f"{name} is not supported with beam search.", param=name)
        try:
            return StructuredOutputsParams(**spec)
        except ValueError as e:
            raise APIError(400, str(e).replace("structured_outputs", name, 1), param=name) from None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None = None,
                        prompt_logprobs: int | None = None) -> SamplingParams:
        """Raises APIError(400) for parameter values SamplingParams rejects."""
        try:
            return SamplingParams(
                n=self.n, temperature=1.0 if self.temperature is None else self.temperature,
                top_p=1.0 if self.top_p is None else self.top_p, top_k=-1 if self.top_k is None else self.top_k,
                min_p=self.min_p or 0.0, repetition_penalty=self.repetition_penalty or 1.0,
                presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
                seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
                stop_token_ids=self.stop_token_ids, include_stop_str_in_output=self.include_stop_str_in_output,
                ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
                skip_special_tokens=self.skip_special_tokens, use_beam_search=self.use_beam_search,
                beam_width=self.beam_width, length_penalty=self.length_penalty, early_stopping=self.early_stopping,
                logit_bias=self.token_logit_bias(), allowed_token_ids=self.allowed_token_ids,
                bad_words=self.bad_words, structured_outputs=self.structured_outputs_params(),
                prediction=self.prediction.text() or None if self.prediction is not None else None)
        except ValueError as e:
            raise APIError(400, str(e), param=str(e).split(" ", 1)[0]) from None

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(SamplingRequest):
    prompt: str | list[Int] | list[str] | list[list[Int]]
    max_tokens: Annotated[int, Field(ge=0), WHOLE] | None = 16  # 0: score the prompt only (echo, prompt_logprobs)
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0), WHOLE] | None = None  # at most the engine's max_logprobs
    return_tokens_as_token_ids: bool = False  # logprobs' tokens as "token_id:<id>" (vLLM's)
    best_of: Int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.suffix:
            raise APIError(400, "suffix is not supported.", param="suffix")
        if self.best_of is not None and self.best_of != self.n:
            raise APIError(400, "best_of must be unset or equal to n.", param="best_of")
        if self.max_tokens == 0 and not (self.echo or self.prompt_logprobs is not None):
            raise APIError(400, "max_tokens 0 scores the prompt only: it needs echo or prompt_logprobs.",
                           param="max_tokens")
        if self.max_tokens == 0 and self.stream:
            raise APIError(400, "max_tokens 0 (scoring) cannot be streamed.", param="max_tokens")


class TextPart(Request):
    type: Literal["text"]
    text: str


class FunctionCallIn(Request):
    name: str
    arguments: str | dict[str, Any]


class ToolCallIn(Request):
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(Request):
    # as check_contents has it: content, unless it is an assistant turn with tool calls
    model_config = ConfigDict(json_schema_extra={"anyOf": [
        {"required": ["content"], "properties": {"content": {"type": ["string", "array"]}}},
        {"required": ["tool_calls"], "properties": {"role": {"const": "assistant"},
                                                     "tool_calls": {"type": "array", "minItems": 1}}}]})
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns that called tools
    tool_call_id: str | None = None  # role "tool": the call this result answers

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""

    def template_message(self) -> dict[str, Any]:
        """The message as the chat template gets it (InputProcessor.render_chat): role, text, name, tool fields."""
        msg: dict[str, Any] = {"role": self.role, "content": self.text(), **({"name": self.name} if self.name else {})}
        if self.tool_call_id is not None:
            msg["tool_call_id"] = self.tool_call_id
        if self.tool_calls:
            msg["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": c.function.arguments}}
                                 for c in self.tool_calls]
        return msg


def check_contents(messages: list[ChatMessage]) -> None:
    for i, m in enumerate(messages):
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise APIError(400, f"messages[{i}] has no content.", param="messages")


MAX_TOOLS = 128


class FunctionDef(Request):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(Request):
    name: str


class NamedToolChoice(Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Annotated[int, Field(ge=1), WHOLE] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1), WHOLE] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0), WHOLE] | None = None  # at most the engine's max_logprobs
    return_tokens_as_token_ids: bool = False  # logprobs' tokens as "token_id:<id>" (vLLM's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the last message's turn left open (with add_generation_prompt off)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict[str, bool | int | float | str | None] | None = None  # endpoints.base.TEMPLATE_KWARGS
    # vLLM's: reasoning tokens before `</think>` is forced
    thinking_token_budget: Annotated[int, Field(ge=0), WHOLE] | None = None
    _reasoning_tags: ReasoningTags | None = PrivateAttr(None)  # the server's reasoning parser's (the frontend's)

    @property
    def reasoning_tags(self) -> ReasoningTags | None:
        return self._reasoning_tags

    @reasoning_tags.setter
    def reasoning_tags(self, tags: ReasoningTags | None) -> None:
        self._reasoning_tags = tags

    @property
    def tools_active(self) -> bool:
        """Tools are offered to the model (and its output is parsed for calls)."""
        return bool(self.tools) and self.tool_choice != "none"

    def called_functions(self) -> list[dict[str, Any]] | None:
        """The functions the output must call (tool_choice "required" or a named one), else None."""
        if not self.tools_active or self.tool_choice in (None, "auto"):
            return None
        functions = [t.function.model_dump(exclude_none=True) for t in self.tools]
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            functions = [f for f in functions if f["name"] == name]
            if not functions:
                raise APIError(400, f"tool_choice names the function {name!r}, which is not in tools.",
                               param="tool_choice")
        return functions

    def check_supported(self) -> None:
        super().check_supported()
        check_contents(self.messages)
        if self.top_logprobs and not self.logprobs:
            raise APIError(400, "top_logprobs requires logprobs to be true.", param="top_logprobs")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise APIError(400, "tool_choice needs tools.", param="tool_choice")
        if self.called_functions() is not None and self.use_beam_search:
            raise APIError(400, "tool_choice 'required' or a named function is not supported with beam search.",
                           param="tool_choice")
        if self.called_functions() is not None and self.structured_outputs_params() is not None:
            raise APIError(400, "tool_choice 'required' or a named function cannot be combined with another output "
                                "constraint.", param="tool_choice")


class TokenizeRequest(Request):
    model_config = ConfigDict(json_schema_extra={"oneOf": [  # exactly one of prompt, messages or content
        {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
        {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
        {"required": ["content"], "properties": {"content": {"type": "string"}}}]})
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    content: str | None = None  # llama-server's prompt field, with its add_special (default False)
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages
    add_special: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(Request):
    model: str | None = None
    tokens: list[Int]
