"""The tokenizer endpoints of one served model: POST /tokenize (a prompt, or chat messages as the template renders
them), POST /detokenize, GET /tokenizer_info. Their answers are typed bodies the app renders as JSON."""
from __future__ import annotations

import json

from pagedlm.server import protocol as P
from pagedlm.server.endpoints.base import EndpointBase
from pagedlm.server.protocol import APIError


class TokenizeEndpoint(EndpointBase):
    def tokenize(self, req: P.TokenizeRequest) -> P.TokenizeResponse:
        if sum(x is not None for x in (req.prompt, req.messages, req.content)) != 1:
            raise APIError(400, "Give exactly one of `prompt`, `messages` or `content` (llama-server's).")
        if req.content is not None:  # llama-server's field and default: no special tokens unless add_special
            text, add_special = req.content, req.add_special
            self.limits.check_prompt_chars(text, "content")
        elif req.messages is not None:
            P.check_contents(req.messages)
            text = self.render_chat(req.messages, req.add_generation_prompt,
                                    continue_final_message=req.continue_final_message)
            add_special = bool(req.add_special_tokens)
        else:
            text, add_special = req.prompt, req.add_special_tokens is not False
            self.limits.check_prompt_chars(text, "prompt")
        ids = self.tok.encode(text, add_special_tokens=add_special)
        strs = [t or "" for t in self.tok.hf.convert_ids_to_tokens(ids)] if req.return_token_strs else None
        return P.TokenizeResponse(count=len(ids), max_model_len=self.processor.max_model_len, tokens=ids,
                                  token_strs=strs)

    def detokenize(self, req: P.DetokenizeRequest) -> P.DetokenizeResponse:
        vocab = len(self.tok.hf)
        if any(not 0 <= t < vocab for t in req.tokens):
            raise APIError(400, f"Token ids must be in [0, {vocab}).", param="tokens")
        text = self.tok.decode(req.tokens, skip_special_tokens=False)
        return P.DetokenizeResponse(prompt=text, content=text)

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
