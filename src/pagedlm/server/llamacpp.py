"""llama.cpp's server API on the same app, for the clients written against `llama-server`: POST /completion (one
JSON answer, or with `stream: true` SSE events of `{content, stop}` and no `[DONE]`) and GET /props. A completion
runs as /v1/completions does (bridge.py), with the same checks, limits, routing and engine features; its answer
is translated back (`content`, `stop_type` eos / word / limit, `stopping_word`, token counts, `timings`, and
`completion_probabilities` for `n_probs`). Options that tune llama.cpp's runtime (`cache_prompt`, `id_slot`,
`n_keep`, `samplers`, ...) are unknown fields, as are sampling options this server does not have (mirostat,
typical_p, dry_*, xtc_*); unset options take the server's defaults, not llama.cpp's. /tokenize's `content` and
/detokenize's `content` answer are served beside vLLM's fields (endpoints/tokenize.py)."""
from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import Field, WithJsonSchema

from pagedlm import __version__
from pagedlm.sampling.params import MAX_LOGIT_BIAS_ENTRIES
from pagedlm.server.bridge import Bridge, answer, logprobs_by_id, reply, restream, streaming
from pagedlm.server.protocol import WHOLE, APIError, Int
from pagedlm.server.protocol import Request as Body
from pagedlm.server.sse import StreamFailed, chunks

SSE = "text/event-stream"
MAX_N_PROBS = 20
MAX_BIAS_TEXT = 64  # characters of one logit_bias text
# the OpenAI request's fields that errors name, as llama-server's request has them
_FIELDS = {"max_tokens": "n_predict", "repetition_penalty": "repeat_penalty", "logprobs": "n_probs",
           "structured_outputs": "grammar or json_schema"}
_NONE_OR_FALSE = WithJsonSchema({"anyOf": [{"const": False}, {"type": "null"}]})


class CompletionRequest(Body):
    """llama.cpp's /completion body: the fields this server maps (others are unknown fields)."""

    model: str | None = None
    prompt: str | list[Int]
    n_predict: Int = -1  # -1: until the context is full
    stream: bool = False
    temperature: float | None = None
    top_k: Int | None = None  # <= 0: off
    top_p: float | None = None
    min_p: float | None = None
    seed: Int | None = None  # -1: random
    stop: list[str] | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    ignore_eos: bool = False
    # bounded before its texts are tokenized (on the event loop): MAX_LOGIT_BIAS_ENTRIES pieces of text, each short
    logit_bias: Annotated[list[tuple[Int | Annotated[str, Field(max_length=MAX_BIAS_TEXT)], float | bool]],
                          Field(max_length=MAX_LOGIT_BIAS_ENTRIES)] | dict[str, float] | None = None
    n_probs: Annotated[int, Field(ge=0, le=MAX_N_PROBS), WHOLE] = 0
    grammar: str | None = None
    json_schema: dict[str, Any] | None = None
    return_tokens: Annotated[bool | None, _NONE_OR_FALSE] = None  # a 400: token ids are not returned here


def add_llamacpp_routes(app: FastAPI, bridge: Bridge) -> None:
    api = LlamaCppAPI(bridge)
    app.post("/completion")(api.completion)
    app.get("/props")(api.props)


class LlamaCppAPI:
    def __init__(self, bridge: Bridge) -> None:
        self.bridge, self.front = bridge, bridge.front

    async def completion(self, request: Request) -> Response:
        arrival, t0 = time.monotonic(), time.monotonic_ns()
        req, unknown = await self.bridge.parse(request, CompletionRequest)
        if req.return_tokens:
            raise APIError(400, "`return_tokens` is not supported by this server (ask /tokenize for the ids of "
                                "the text).", param="return_tokens")
        name = req.model or next(iter(self.front.models))
        body = {"model": name, "prompt": req.prompt, "stream": req.stream, **self._sampling(req, name)}
        if req.stream:
            body["stream_options"] = {"include_usage": True}
        try:
            response = await self.bridge.complete(request, body, arrival)
        except APIError as e:  # named as the client named it
            if e.param in _FIELDS:
                e.message, e.param = e.message.replace(e.param, _FIELDS[e.param]), _FIELDS[e.param]
            raise
        if streaming(response):
            return restream(response, self._events(response.body_iterator, name, req.n_probs, t0), SSE, unknown)
        out = answer(response)
        choice = out["choices"][0]  # a long answer's probabilities are rebuilt token by token: off the event loop
        probs = await self.front.stages.run("render", self._probabilities, choice, req.n_probs, out["model"])
        return reply(response, {"content": choice["text"], "model": out["model"], **_done(choice, out["usage"], t0),
                                **probs}, unknown)

    async def props(self, model: str | None = None) -> Response:
        """llama-server's /props for `model` (default: the first served): its context, slots, chat template."""
        srv = self.front.model(model)
        info = srv.processor.info
        return JSONResponse({
            "default_generation_settings": {"n_ctx": info.max_model_len, "params": {"n_predict": -1}},
            "total_slots": info.max_num_seqs, "model_alias": srv.name, "model_path": info.model_path.name,
            "chat_template": srv.tok.hf.chat_template or "", "modalities": {"vision": False, "audio": False},
            "build_info": f"pagedlm {__version__}"})

    def _sampling(self, req: CompletionRequest, name: str) -> dict[str, Any]:
        out: dict[str, Any] = {
            "temperature": req.temperature,
            "top_k": req.top_k if req.top_k is None or req.top_k > 0 else -1, "top_p": req.top_p,
            "min_p": req.min_p, "seed": None if req.seed == -1 else req.seed, "stop": req.stop,
            "repetition_penalty": req.repeat_penalty, "presence_penalty": req.presence_penalty,
            "frequency_penalty": req.frequency_penalty, "ignore_eos": req.ignore_eos or None,
            "logit_bias": self._logit_bias(req, name), "logprobs": req.n_probs or None,
            "return_tokens_as_token_ids": bool(req.n_probs) or None,
            "structured_outputs": _constraint(req)}
        return {"max_tokens": req.n_predict if req.n_predict >= 0 else None,  # None: until the context is full
                **{k: v for k, v in out.items() if v is not None}}

    def _logit_bias(self, req: CompletionRequest, name: str) -> dict[str, float] | None:
        """llama.cpp's biases (`[[id or text, bias or false], ...]` or `{"id": bias}`) as OpenAI's `{"id": bias}`:
        a text biases each of its tokens; `false` bans a token (-100)."""
        if req.logit_bias is None or isinstance(req.logit_bias, dict):
            return req.logit_bias
        if self.front.is_auto(name) and any(isinstance(key, str) for key, _ in req.logit_bias):
            raise APIError(400, "logit_bias by text needs a served model's name (the router's models tokenize "
                                "differently).", param="logit_bias")
        tok = self.front.model(name).tok
        out: dict[str, float] = {}
        for key, bias in req.logit_bias:
            value = -100.0 if bias is False else float(bias)
            ids = [key] if isinstance(key, int) else tok.encode(key, add_special_tokens=False)
            out.update((str(i), value) for i in ids)
        return out

    def _probabilities(self, choice: dict[str, Any], n_probs: int, model: str) -> dict[str, Any]:
        """`completion_probabilities` in llama.cpp's form, `[{id, token, bytes, logprob, top_logprobs: [{id, token,
        bytes, logprob}]}]` (the `n_probs` most likely first), from a choice's logprobs by token id."""
        lp = choice.get("logprobs") if n_probs else None
        if not lp or not lp.get("tokens"):
            return {}
        return {"completion_probabilities": logprobs_by_id(self.front.model(model).tok, lp, n_probs)}

    async def _events(self, body: AsyncIterator[str], model: str, n_probs: int, t0: int) -> AsyncIterator[str]:
        """The OpenAI stream as llama.cpp's SSE events: one per piece of text, then the final one with the stop
        reason, counts and timings (no `[DONE]`)."""
        last: dict[str, Any] = {}
        usage: dict[str, Any] = {}
        try:
            async for chunk in chunks(body):
                usage = chunk.get("usage") or usage
                for c in chunk.get("choices", []):
                    if c.get("text") or c.get("logprobs"):
                        yield _event({"content": c.get("text") or "", "stop": False,
                                      **self._probabilities(c, n_probs, chunk.get("model") or model)})
                    if c.get("finish_reason"):
                        last = c
        except StreamFailed as e:
            yield _event({"error": {"code": 500, "message": e.message, "type": e.type}})
            return
        yield _event({"content": "", "model": model, **_done(last, usage, t0)})


def _constraint(req: CompletionRequest) -> dict[str, Any] | None:
    if req.grammar and req.json_schema is not None:
        raise APIError(400, "Give one of `grammar` or `json_schema`.", param="grammar")
    if req.grammar:
        return {"grammar": req.grammar}
    return {"json": req.json_schema} if req.json_schema is not None else None


def _done(choice: dict[str, Any], usage: dict[str, Any], t0: int) -> dict[str, Any]:
    """The final fields of an answer: why it stopped (eos, word: a stop string, limit: n_predict or the context),
    the counts and the timings."""
    reason, stopped_by = choice.get("finish_reason"), choice.get("stop_reason")
    kind = "limit" if reason == "length" else "word" if isinstance(stopped_by, str) else "eos"
    ms = (time.monotonic_ns() - t0) / 1e6
    prompt_n, predicted_n = usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0)
    return {"stop": True, "stop_type": kind, "stopping_word": stopped_by if kind == "word" else "",
            "tokens_predicted": predicted_n, "tokens_evaluated": prompt_n, "truncated": False,
            "timings": {"prompt_n": prompt_n, "predicted_n": predicted_n, "predicted_ms": ms,
                        "predicted_per_second": predicted_n / ms * 1e3 if ms > 0 else 0.0}}


def _event(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"
