"""The auto model: requests for the dispatcher's name (`auto`) run on the served model the router picks
(dispatch.py). A model that refuses, fails or is down before anything reached the client is replaced by the
router's fallback; under a cascade policy the weak model answers first and the router judges its answer (the typed
`Answer`, endpoints/results.py) before the client sees anything. The answer carries the decision in the
`x-pagedlm-routed-model`, `x-pagedlm-route-reason` and `x-pagedlm-route-detail` headers."""
from __future__ import annotations

import functools
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from typing import TypeVar

from fastapi import Request
from fastapi.responses import Response

from pagedlm.router import BudgetExceededError, CascadePolicy, Decision, NoCandidateError, WeakAnswer
from pagedlm.server import protocol as P
from pagedlm.server.dispatch import Dispatcher
from pagedlm.server.endpoints import Answer, Result, ServedModel, render
from pagedlm.server.endpoints.base import request_ids
from pagedlm.server.endpoints.render import replay
from pagedlm.server.metrics import ServerMetrics
from pagedlm.server.protocol import RETRY_AFTER_S, APIError, Unavailable
from pagedlm.server.wire import header_text

logger = logging.getLogger(__name__)

D = TypeVar("D")
Run = Callable[..., Awaitable[Result]]  # an endpoint of ServedModel: run(model, req=..., rid=...)
OpenAIRequest = P.CompletionRequest | P.ChatCompletionRequest


@dataclass
class _AutoRequest:
    """What the router needs of one request for the auto model."""

    request: Request
    text: str  # routed on
    max_tokens: int | None
    cost_tokens: tuple[int, int]  # bounds on its (prompt, completion) tokens, for budget holds
    num_prompts: int
    id_prefix: str

    @property
    def key(self) -> str | None:
        return getattr(self.request.state, "api_key", None)


class AutoModel:
    """Runs requests for `dispatcher.name` on `models` (the served ones, by name), counting in `metrics`."""

    def __init__(self, dispatcher: Dispatcher, models: dict[str, ServedModel], metrics: ServerMetrics) -> None:
        self.dispatcher, self.models, self.metrics = dispatcher, models, metrics
        self.router = dispatcher.router

    def model_card(self, created: int) -> P.ModelCard:
        lens = [self.models[m].engine.max_model_len for m in self.router.models]
        return P.ModelCard(id=self.dispatcher.name, created=created, root=None, max_model_len=min(lens))

    async def complete(self, request: Request, req: P.CompletionRequest, arrival: float) -> Response:
        """A completion request, checked and admitted by the frontend. Text prompts only (each model has its own
        token ids); a cascade needs one prompt and no echo."""
        text = _routing_text(req.prompt)
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        cost_tokens = (sum(len(p.encode()) + 32 for p in prompts),
                       (req.max_tokens or self.dispatcher.max_model_len) * _width(req) * len(prompts))
        r = _AutoRequest(request, text, req.max_tokens, cost_tokens, len(prompts), "cmpl")
        run = functools.partial(ServedModel.completions, request=request, arrival=arrival, routed=True)
        return await self._dispatch(r, req, run, cascade=len(prompts) == 1 and not req.echo)

    async def chat(self, request: Request, req: P.ChatCompletionRequest, arrival: float) -> Response:
        """A chat request, checked and admitted by the frontend, routed on its last user message."""
        users = [m.text() for m in req.messages if m.role == "user"]
        text = users[-1] if users else "\n".join(m.text() for m in req.messages)
        max_tokens = req.max_completion_tokens or req.max_tokens
        cost_tokens = (64 + sum(len(m.text().encode()) + 16 for m in req.messages),
                       (max_tokens or self.dispatcher.max_model_len) * _width(req))
        r = _AutoRequest(request, text, max_tokens, cost_tokens, 1, "chatcmpl")
        run = functools.partial(ServedModel.chat_completions, request=request, arrival=arrival, routed=True)
        return await self._dispatch(r, req, run, cascade=True)

    async def _dispatch(self, r: _AutoRequest, req: OpenAIRequest, run: Run, cascade: bool) -> Response:
        """`run` on the router's model (with fallback); in cascade mode, a request whose answer has one choice is
        answered by the weak model first (see `_cascade`). The result rendered, with the decision's headers."""
        decision = await self._decision(self.dispatcher.decide(r.text, r.max_tokens, r.key, r.cost_tokens))
        if (cascade and isinstance(self.router.policy, CascadePolicy) and req.n == 1 and not req.use_beam_search
                and not self.router.models[decision.model].strong):
            result, decision = await self._cascade(r, req, run, decision)
        else:
            result, decision = await self._run_on(r, decision, functools.partial(run, req=req))
        self.router.record_served(decision)
        self.metrics.router_requests.labels(decision.model, decision.category).inc()
        response = render(result)
        response.headers["x-pagedlm-routed-model"] = decision.model
        response.headers["x-pagedlm-route-reason"] = decision.category
        response.headers["x-pagedlm-route-detail"] = header_text(decision.reason)
        return response

    async def _run_on(self, r: _AutoRequest, decision: Decision, run: Run) -> tuple[Result, Decision]:
        """`run` on `decision`'s model; on `Unavailable`, on the router's fallback, until one takes it. The
        request's budget hold is settled by the dispatcher when its engine requests end, or dropped if it never
        ran."""
        dispatcher = self.dispatcher
        tried: list[str] = []
        while True:
            rid = f"{r.id_prefix}-{uuid.uuid4().hex}"
            ids = request_ids(rid, r.num_prompts)
            dispatcher.track(decision, ids)
            try:
                result = await run(self.models[decision.model], rid=rid)
            except Unavailable as e:
                dispatcher.untrack(decision, ids)
                logger.warning("Routed model %s is unavailable (%s); falling back", decision.model, e.message)
                tried.append(decision.model)
                try:
                    nxt = await self._decision(dispatcher.fallback(decision, r.text, r.max_tokens, tried, r.key,
                                                                   r.cost_tokens))
                except Unavailable:
                    raise e from None
                self.metrics.router_fallbacks.labels(decision.model, nxt.model).inc()
                decision = nxt
                continue
            except APIError:
                dispatcher.untrack(decision, ids)  # refused before it ran (invalid for this model)
                raise
            self.router.report_success(decision.model)
            return result, decision

    async def _cascade(self, r: _AutoRequest, req: OpenAIRequest, run: Run,
                       decision: Decision) -> tuple[Result, Decision]:
        """The weak model answers in full (not streamed, with logprobs, `samples` choices); the router judges the
        answer's token logprobs (and the samples' agreement). A confident answer goes back to the client (as a
        stream if it asked for one); otherwise the request is re-run on the strong model, as the client asked,
        and nothing of the weak answer is sent."""
        chat = isinstance(req, P.ChatCompletionRequest)
        samples = self.router.policy.samples
        inner = req.model_copy(update={"stream": False, "stream_options": None, "n": samples, **(
            {"logprobs": True, "top_logprobs": req.top_logprobs or 0} if chat else {"logprobs": req.logprobs or 0})})
        result, decision = await self._run_on(r, decision, functools.partial(run, req=inner))
        assert isinstance(result, Answer)  # not streamed
        prompt_tokens = result.body.usage.prompt_tokens if result.body.usage else 0
        texts, tokens = _keep_first_choice(result, samples)
        if self.router.models[decision.model].strong:  # a fallback took it to the strong tier
            return _as_asked(result, req), decision
        cost = self._count_samples(decision, prompt_tokens, tokens)
        answer = WeakAnswer.of(result.token_logprobs(result.body.choices[0]), texts)
        try:
            strong, why = await self._decision(self.dispatcher.escalate(decision, answer, r.text, r.max_tokens, r.key,
                                                                        r.cost_tokens))
        except APIError as e:  # no strong model can take it now (budget, down): the weak answer stands
            strong, why = None, f"cascade: weak answer kept, the strong model is unavailable ({e.message})"
        self.metrics.router_cascade.labels("escalated" if strong else "kept").inc()
        if strong is None:
            return _as_asked(result, req), replace(decision, reason=why + cost, policy_strong=False)
        return await self._run_on(r, replace(strong, reason=strong.reason + cost), functools.partial(run, req=req))

    def _count_samples(self, decision: Decision, prompt_tokens: int, tokens: list[int]) -> str:
        """With k > 1 samples: their extra cost counted in the metrics, and said for the route detail."""
        if len(tokens) < 2:
            return ""
        cost = self.router.samples_cost(decision, prompt_tokens, tokens)
        self.metrics.router_cascade_tokens.labels("extra_decode").inc(cost.extra_decode_tokens)
        self.metrics.router_cascade_tokens.labels("prefill_reused").inc(cost.prefill_reused_tokens)
        self.metrics.router_cascade_cost.inc(cost.extra_cost)
        return f"; {cost.describe()}"

    async def _decision(self, decision: Awaitable[D]) -> D:
        """The dispatcher's decision; 503 when no model can take the request, 429 past every spend cap."""
        t0 = time.perf_counter()
        try:
            return await decision
        except NoCandidateError as e:
            raise Unavailable(503, f"No model can take the request: {e}", type="server_error",
                               code="no_model_available", headers={"Retry-After": str(RETRY_AFTER_S)}) from None
        except BudgetExceededError as e:
            self.metrics.router_budget_refusals.inc()
            raise APIError(429, f"Routing budget exhausted: {e}", type="insufficient_quota", code="budget_exceeded",
                           headers={"Retry-After": str(math.ceil(e.retry_after_s))}) from None
        finally:
            self.metrics.router_decision.observe(time.perf_counter() - t0)


def _keep_first_choice(answer: Answer, samples: int) -> tuple[list[str], list[int]]:
    """With `samples` > 1 (n=k drawn at once): the text and the decode tokens of every choice, and `answer` cut to
    its first (the answer kept; its usage counts that choice's tokens alone). With one sample: nothing, `answer`
    unchanged."""
    if samples <= 1:
        return [], []
    choices = answer.choices()
    texts = [answer.text(c) for c in choices]
    tokens = [len(answer.token_logprobs(c)) for c in choices]  # the cascade asks for logprobs: one per token
    first = choices[0]
    answer.body.choices = [first]
    usage = answer.body.usage
    if usage:
        usage.completion_tokens = tokens[0]
        usage.total_tokens = usage.prompt_tokens + usage.completion_tokens
    return texts, tokens


def _as_asked(answer: Answer, req: OpenAIRequest) -> Result:
    """A cascade's complete answer, as the client asked for it: logprobs only if asked, streamed if asked."""
    asked = req.logprobs if isinstance(req, P.ChatCompletionRequest) else req.logprobs is not None
    if not asked:
        for c in answer.body.choices:
            c.logprobs = None
    return replay(answer, req) if req.stream else answer


def _routing_text(prompt: str | list[int] | list[str] | list[list[int]]) -> str:
    """The text a completion request is routed on; token ids cannot be routed (each model has its own)."""
    if isinstance(prompt, str):
        return prompt
    if prompt and all(isinstance(p, str) for p in prompt):
        return "\n".join(prompt)
    raise APIError(400, "Token-id prompts need a named model (token ids differ between models).", param="prompt")


def _width(req: P.OpenAIRequest) -> int:
    return max(req.n, (req.beam_width or req.n) if req.use_beam_search else 1)
