"""Ollama's native API on the same app (and, with --ollama-port, on a second port such as 11434): /api/chat and
/api/generate (NDJSON streams by default, `stream: false` for one object), /api/tags, /api/show, /api/ps,
/api/version and /api/pull (of a served model: nothing is downloaded). Errors are Ollama's `{"error": "..."}`
(api_errors.py). Generation runs through the chat path (bridge.py): the same checks, limits, routing and engine
features as /v1/chat/completions, logprobs included (`logprobs`, `top_logprobs`: each answer object or NDJSON line
carries its tokens'); a raw /api/generate runs as a completion."""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagedlm import __version__
from pagedlm.server import ollama_protocol as O
from pagedlm.server.bridge import Bridge, answer, prefill, reply, restream, streaming
from pagedlm.server.endpoints import ServedModel
from pagedlm.server.protocol import APIError
from pagedlm.server.sse import StreamFailed, chunks

NDJSON = "application/x-ndjson"
_EPOCH_FAR = "2318-01-01T00:00:00Z"  # /api/ps: models never unload


def add_ollama_routes(app: FastAPI, bridge: Bridge) -> None:
    api = OllamaAPI(bridge)
    app.post("/api/chat")(api.chat)
    app.post("/api/generate")(api.generate)
    app.get("/api/tags")(api.tags)
    app.post("/api/show")(api.show)
    app.get("/api/ps")(api.ps)
    app.get("/api/version")(api.version)
    app.head("/api/version")(api.version)
    app.post("/api/pull")(api.pull)
    for method, path in (("POST", "/api/push"), ("POST", "/api/create"), ("POST", "/api/copy"),
                         ("DELETE", "/api/delete"), ("HEAD", "/api/blobs/{digest}"), ("POST", "/api/blobs/{digest}")):
        app.add_api_route(path, api.manage, methods=[method])


_UNSUPPORTED_GENERATE = {  # Ollama's /api/generate fields this server refuses, and what to do instead
    "suffix": "fill-in-the-middle needs a model trained for it: send the text before the gap as the prompt",
    "template": "the model's own chat template is used: send the messages to /api/chat",
    "context": "send the conversation to /api/chat instead of a context",
}


class OllamaAPI:
    def __init__(self, bridge: Bridge) -> None:
        self.bridge, self.front = bridge, bridge.front

    def resolve(self, model: str | None) -> str:
        """The served name of an Ollama model name (`tiny` or `tiny:latest`); 404 in Ollama's words."""
        for name in (model, (model or "").removesuffix(":latest")):
            if name in self.front.models or self.front.is_auto(name):
                return name
        raise APIError(404, f'model "{model}" not found, try pulling it first', param="model",
                       code="model_not_found")

    def max_model_len(self, name: str) -> int:
        if self.front.is_auto(name):
            return self.front.dispatcher.max_model_len
        return self.front.model(name).processor.max_model_len

    # --- generation ---
    async def chat(self, request: Request) -> Response:
        arrival, t0 = time.monotonic(), time.monotonic_ns()
        req, unknown = await self.bridge.parse(request, O.ChatRequest)
        name = self.resolve(req.model)
        if not req.messages:
            return _loaded(req.model, "message")
        messages = O.chat_messages(req.messages)
        body = {"model": name, "messages": messages, **prefill(messages), **self._common(req, name)}
        if req.tools:
            body["tools"] = [{"type": "function", **t} if "type" not in t else t for t in req.tools]
        response = await self.bridge.chat(request, body, arrival)
        return await self._answer(response, req, "message", t0, unknown)

    async def generate(self, request: Request) -> Response:
        arrival, t0 = time.monotonic(), time.monotonic_ns()
        req, unknown = await self.bridge.parse(request, O.GenerateRequest)
        name = self.resolve(req.model)
        if req.images:
            raise APIError(400, O.NO_IMAGES, param="images")
        for field, why in _UNSUPPORTED_GENERATE.items():
            if getattr(req, field):
                raise APIError(400, f"`{field}` is not supported by this server ({why}).", param=field)
        if not req.prompt:
            return _loaded(req.model, "response")
        common = self._common(req, name)
        if req.raw:
            common.pop("chat_template_kwargs", None)
            common.pop("top_logprobs", None)
            body = {"model": name, "prompt": req.prompt, "max_tokens": common.pop("max_tokens", None), **common,
                    **O.logprob_fields(req, raw=True)}
            response = await self.bridge.complete(request, body, arrival)
        else:
            system = [{"role": "system", "content": req.system}] if req.system else []
            body = {"model": name, "messages": [*system, {"role": "user", "content": req.prompt}], **common}
            response = await self.bridge.chat(request, body, arrival)
        return await self._answer(response, req, "response", t0, unknown)

    def _tok(self, name: str):
        """The tokenizer of the served model that answered (the answer's `model`: routed ones name theirs)."""
        return self.front.models.get(name, self.front.default).tok

    def _common(self, req: O.ChatRequest | O.GenerateRequest, name: str) -> dict[str, Any]:
        body = {**O.sampling_fields(req.options, self.max_model_len(name)), **O.format_fields(req.format),
                **O.logprob_fields(req, raw=False), "stream": req.stream}
        if req.stream:
            body["stream_options"] = {"include_usage": True}
        if req.think is not None:  # a level ("low", ...) means on: templates take enable_thinking
            body["chat_template_kwargs"] = {"enable_thinking": bool(req.think)}
        return body

    async def _answer(self, response: Response, req: O.ChatRequest | O.GenerateRequest, key: str, t0: int,
                unknown: list[str]) -> Response:
        """The OpenAI answer as Ollama's: one object, or NDJSON lines of deltas (with their tokens' logprobs, when
        asked) and a final `done` line."""
        model, k = req.model, req.top_logprobs or 0
        if streaming(response):
            return restream(response, self._lines(response.body_iterator, model, key, t0, k), NDJSON, unknown)
        body = answer(response)
        choice = body["choices"][0]
        message = choice.get("message", {})
        thinking = message.get("reasoning_content")
        if key == "message":
            out = {"message": _message(message.get("content") or "", message.get("tool_calls"), thinking)}
        else:
            out = {"response": choice.get("text", message.get("content")) or "",
                   **({"thinking": thinking} if thinking else {})}
        lps = None
        if choice.get("logprobs"):  # a long raw answer's are rebuilt token by token: off the event loop
            lps = await self.front.stages.run("render", O.logprobs, choice, k, self._tok(body["model"]))
        return reply(response, {**_head(model), **out, **_done(choice["finish_reason"], body["usage"], t0),
                                **({"logprobs": lps} if lps else {})}, unknown)

    async def _lines(self, body: AsyncIterator[str], model: str, key: str, t0: int,
                     k: int) -> AsyncIterator[str]:
        finish, usage = None, {}
        try:
            async for chunk in chunks(body):
                usage = chunk.get("usage") or usage
                for c in chunk.get("choices", []):
                    delta = c.get("delta", {})
                    text = c.get("text", delta.get("content")) or ""
                    calls, thinking = delta.get("tool_calls"), delta.get("reasoning_content")
                    lps = O.logprobs(c, k, self._tok(chunk["model"])) if c.get("logprobs") else None
                    if text or calls or thinking or lps:
                        if key == "message":
                            part = {"message": _message(text, calls, thinking)}
                        else:
                            part = {"response": text, **({"thinking": thinking} if thinking else {})}
                        yield _line({**_head(model), **part, "done": False, **({"logprobs": lps} if lps else {})})
                    finish = c.get("finish_reason") or finish
        except StreamFailed as e:
            yield _line({"error": e.message})
            return
        empty = _message("", None) if key == "message" else ""
        yield _line({**_head(model), key: empty, **_done(finish or "stop", usage, t0)})

    # --- models ---
    async def tags(self) -> Response:
        return JSONResponse({"models": [self._entry(n, m) for n, m in self.front.models.items()]})

    async def ps(self) -> Response:
        return JSONResponse({"models": [{**self._entry(n, m), "expires_at": _EPOCH_FAR, "size_vram": 0,
                                         "context_length": m.processor.max_model_len}
                                        for n, m in self.front.models.items()]})

    async def show(self, request: Request) -> Response:
        req, _ = await self.bridge.parse(request, O.ShowRequest)
        if not (req.model or req.name):
            raise APIError(400, "model is required", param="model")
        name = self.resolve(req.model or req.name)
        if self.front.is_auto(name):
            raise APIError(400, f"`{name}` is the router: it chooses one of {sorted(self.front.models)}.",
                           param="model")
        srv = self.front.model(name)
        info = srv.processor.info
        family = _family(info.family)
        template = srv.tok.hf.chat_template or ""
        return JSONResponse({
            "license": "", "modelfile": "", "parameters": "", "template": template,
            "details": _details(srv), "modified_at": _modified(info.model_path),
            "model_info": {**info.metadata, "general.architecture": family,
                           "general.parameter_count": info.num_parameters,
                           f"{family}.context_length": info.max_model_len},
            "capabilities": ["completion", "tools"]})

    async def version(self) -> Response:
        return JSONResponse({"version": __version__})

    async def pull(self, request: Request) -> Response:
        """Ollama's `pull` (which `ollama run` sends for a model /api/show does not know): a served model is there
        already; any other is a 404 naming the served ones, as this server serves what it was started with."""
        req, _ = await self.bridge.parse(request, O.PullRequest)
        if not (req.model or req.name):
            raise APIError(400, "model is required", param="model")
        try:
            self.resolve(req.model or req.name)
        except APIError:
            raise APIError(404, f'model "{req.model or req.name}" is not served here, and this server does not '
                                f"download models: it serves {sorted(self.front.models)}, the models it was "
                                "started with (`pagedlm serve --model ...`)", param="model",
                           code="model_not_found") from None
        if req.stream:
            return Response(_line({"status": "success"}), media_type=NDJSON)
        return JSONResponse({"status": "success"})

    async def manage(self, request: Request) -> Response:
        raise APIError(403, f"{request.url.path} is refused: this server serves the models it was started with "
                            "and does not change, copy or push them", code="model_management")

    def _entry(self, name: str, srv: ServedModel) -> dict[str, Any]:
        path = srv.processor.info.model_path
        size = _size(path)
        digest = hashlib.sha256(f"{name}\0{path}\0{size}".encode()).hexdigest()  # an id, not a content hash
        return {"name": name, "model": name, "modified_at": _modified(path), "size": size, "digest": digest,
                "details": _details(srv)}


def _details(srv: ServedModel) -> dict[str, Any]:
    info = srv.processor.info
    family = _family(info.family)
    return {"parent_model": "", "format": "gguf" if info.model_path.suffix == ".gguf" else "safetensors",
            "family": family, "families": [family], "parameter_size": _parameter_size(info.num_parameters),
            "quantization_level": info.file_type or info.weights.upper()}


def _family(model_type: str) -> str:
    return model_type.removesuffix("_text") or "unknown"


def _parameter_size(n: int) -> str:
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if n >= scale:
            return f"{n / scale:.2f}".rstrip("0").rstrip(".") + unit
    return str(n)


def _size(path: Path) -> int:
    try:
        return sum(p.stat().st_size for p in path.iterdir() if p.is_file()) if path.is_dir() else path.stat().st_size
    except OSError:
        return 0


def _modified(path: Path) -> str:
    try:
        return _iso(path.stat().st_mtime)
    except OSError:
        return _iso(time.time())


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.timezone.utc).isoformat().replace("+00:00", "Z")


def _head(model: str) -> dict[str, Any]:
    return {"model": model, "created_at": _iso(time.time())}


def _message(content: str, calls: list[dict[str, Any]] | None, thinking: str | None = None) -> dict[str, Any]:
    msg: dict[str, Any] = {"role": "assistant", "content": content, **({"thinking": thinking} if thinking else {})}
    converted = O.tool_calls(calls)
    if converted:
        msg["tool_calls"] = converted
    return msg


def _done(finish: str | None, usage: dict[str, Any], t0: int) -> dict[str, Any]:
    total = time.monotonic_ns() - t0
    return {"done": True, "done_reason": "length" if finish == "length" else "stop", "total_duration": total,
            "load_duration": 0, "prompt_eval_count": usage.get("prompt_tokens", 0), "prompt_eval_duration": 0,
            "eval_count": usage.get("completion_tokens", 0), "eval_duration": total}


def _loaded(model: str, key: str) -> Response:
    """Ollama's answer to an empty chat or prompt: the model is loaded (it always is here)."""
    empty = {"role": "assistant", "content": ""} if key == "message" else ""
    return JSONResponse({**_head(model), key: empty, "done": True, "done_reason": "load"})


def _line(obj: dict[str, Any]) -> str:
    return json.dumps(obj, ensure_ascii=False) + "\n"
