"""A served model's tokenizer and chat template as the endpoints use them: chat messages rendered into a prompt
and the tokenizer endpoints (/tokenize, /detokenize, /tokenizer_info)."""
from __future__ import annotations

import json

from fastapi.responses import Response

from pagedlm.engine.errors import ChatTemplateError
from pagedlm.engine.input_processor import InputProcessor
from pagedlm.server import protocol as P
from pagedlm.server.errors import api_error
from pagedlm.server.limits import RequestLimits
from pagedlm.server.protocol import APIError
from pagedlm.server.wire import json_response

TEMPLATE_KWARGS = frozenset({"enable_thinking", "thinking", "reasoning_effort"})  # template variables a request sets


class TokenizerEndpoints:
    """Part of `ModelServer`: needs its `processor` (the engine's InputProcessor), `tok` (its tokenizer) and
    `limits`."""

    processor: InputProcessor
    limits: RequestLimits
    tool_template: str | None = None  # the template requests with tools are rendered with (None: the model's)

    def chat_prompt(self, messages: list[P.ChatMessage], add_generation_prompt: bool,
                    tools: list[dict] | None = None, template_kwargs: dict | None = None) -> list[int]:
        """The prompt's token ids, as the engine's chat template renders the messages (InputProcessor.render_chat)."""
        text = self._render_chat(messages, add_generation_prompt, tools, template_kwargs)
        return self.tok.encode(text, add_special_tokens=False)

    def chat_request_prompt(self, req: P.ChatCompletionRequest, tools: list[dict] | None = None) -> list[int]:
        """A chat request's prompt: its messages, tools and chat_template_kwargs (only TEMPLATE_KWARGS: 400 for
        others, which could change how the template is applied rather than what it writes)."""
        kwargs = req.chat_template_kwargs or {}
        bad = sorted(set(kwargs) - TEMPLATE_KWARGS)
        if bad:
            raise APIError(400, f"chat_template_kwargs may set {', '.join(sorted(TEMPLATE_KWARGS))}, not "
                                f"{', '.join(bad)}.", param="chat_template_kwargs")
        return self.chat_prompt(req.messages, req.add_generation_prompt, tools, kwargs)

    def _render_chat(self, messages: list[P.ChatMessage], add_generation_prompt: bool,
                     tools: list[dict] | None = None, template_kwargs: dict | None = None) -> str:
        """400 beyond the bounds of `limits` (RequestLimits): the message count before the template runs, the
        rendered characters before anything tokenizes them."""
        self.limits.check_messages(len(messages))
        try:
            text = self.processor.render_chat([m.template_message() for m in messages], add_generation_prompt,
                                              tools, self.tool_template if tools else None, template_kwargs)
        except ChatTemplateError as e:
            raise api_error(e) from None
        self.limits.check_prompt_chars(text, "messages")
        return text

    def tokenize(self, req: P.TokenizeRequest) -> Response:
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "Give exactly one of `prompt` or `messages`.")
        if req.messages is not None:
            P.check_contents(req.messages)
            text = self._render_chat(req.messages, req.add_generation_prompt)
            add_special = bool(req.add_special_tokens)
        else:
            text, add_special = req.prompt, req.add_special_tokens is not False
            self.limits.check_prompt_chars(text, "prompt")
        ids = self.tok.encode(text, add_special_tokens=add_special)
        strs = [t or "" for t in self.tok.hf.convert_ids_to_tokens(ids)] if req.return_token_strs else None
        return json_response(P.TokenizeResponse(count=len(ids), max_model_len=self.processor.max_model_len, tokens=ids,
                                        token_strs=strs))

    def detokenize(self, req: P.DetokenizeRequest) -> Response:
        vocab = len(self.tok.hf)
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"Token ids must be in [0, {vocab}).", param="tokens")
        return json_response(P.DetokenizeResponse(prompt=self.tok.decode(req.tokens, skip_special_tokens=False)))

    def tokenizer_info(self) -> dict:
        """vLLM's shape: the tokenizer's JSON-able init kwargs plus its class, special tokens and template."""
        hf = self.tok.hf
        info = {}
        for key, value in hf.init_kwargs.items():
            value = getattr(value, "content", value)  # AddedToken -> str
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                continue
            info[key] = value
        info.update(tokenizer_class=type(hf).__name__, eos_token=hf.eos_token, bos_token=hf.bos_token,
                    pad_token=hf.pad_token, unk_token=hf.unk_token, chat_template=hf.chat_template,
                    model_max_length=self.processor.max_model_len, vocab_size=len(hf),
                    eos_token_ids=sorted(self.processor.eos_token_ids))
        return info
