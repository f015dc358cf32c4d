"""Per-request bounds the server checks before any work (see docs/serving.md, *Limits and security*)."""
from __future__ import annotations

from dataclasses import dataclass

from pagedlm.sampling.params import SamplingParams
from pagedlm.server import (
    DEFAULT_MAX_CHAT_MESSAGES,
    DEFAULT_MAX_PROMPT_CHARS,
    MAX_GENERATED_LOGPROB_ENTRIES,
    MAX_PROMPT_LOGPROB_ENTRIES,
)
from pagedlm.server import protocol as P
from pagedlm.server.protocol import RETRY_AFTER_S, APIError


@dataclass(frozen=True)
class RequestLimits:
    """Bounds on one request that a served model's endpoints check before the expensive step they bound."""

    max_chat_messages: int = DEFAULT_MAX_CHAT_MESSAGES  # messages of a chat (or /tokenize) request, before rendering
    max_prompt_chars: int = DEFAULT_MAX_PROMPT_CHARS  # characters of a prompt (a rendered chat), before tokenizing
    # logprob entries (k + 1 per generated token) a request may keep: each sequence holds them on the host
    max_logprob_entries: int = MAX_GENERATED_LOGPROB_ENTRIES

    def __post_init__(self) -> None:
        for name in ("max_chat_messages", "max_prompt_chars", "max_logprob_entries"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}.")

    def check_messages(self, count: int) -> None:
        if count > self.max_chat_messages:
            raise APIError(400, f"The request has {count} messages; at most {self.max_chat_messages} are allowed "
                                "(max_chat_messages).", param="messages")

    def check_logprobs(self, prompt_lens: list[int], params: SamplingParams, max_model_len: int) -> int:
        """400 unless the generated-token logprobs the request's sequences would keep, prompts x n (or beam_width)
        x max_tokens (unset: what the context leaves) x (k + 1), are within max_logprob_entries. Returns the
        logprob entries the engine keeps for the request: those, plus its prompts' (positions x (k + 1))."""
        kept = 0 if params.prompt_logprobs is None else sum(prompt_lens) * (params.prompt_logprobs + 1)
        if params.logprobs is None:
            return kept
        width = (params.beam_width or params.n) if params.use_beam_search else params.n
        limit = max_model_len if params.max_tokens is None else params.max_tokens
        tokens = sum(max(0, min(limit, max_model_len - n)) for n in prompt_lens)
        entries = tokens * width * (params.logprobs + 1)
        if entries > self.max_logprob_entries:
            raise APIError(400, f"The request would keep {entries} logprobs ({tokens} tokens x {width} sequences x "
                                f"{params.logprobs + 1}); at most {self.max_logprob_entries} are allowed: lower (or "
                                "set) max_tokens, n or the logprobs.",
                           param="max_tokens" if params.max_tokens is None else "logprobs")
        return kept + entries

    def check_text_prompts(self, prompts: list) -> None:
        for p in prompts:
            if isinstance(p, str):
                self.check_prompt_chars(p, "prompt")

    def check_prompt_chars(self, text: str, param: str) -> None:
        if len(text) > self.max_prompt_chars:
            how = " as the chat template renders it" if param == "messages" else ""
            raise APIError(400, f"The prompt has {len(text)} characters{how}; at most {self.max_prompt_chars} are "
                                "allowed (max_prompt_chars).", param=param)


class KeyLeases:
    """How many engine requests (prompts) each API key's HTTP requests hold, waiting or running: at most `limit`
    per key (0: no cap). A request takes its share through its `Lease` once it knows it; the middleware gives
    the lease back when the response has ended, whichever way. Event-loop thread only."""

    def __init__(self, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"max_requests_per_key must be >= 0, got {limit}.")
        self.limit = limit
        self.held: dict[str, int] = {}

    def lease(self, key: str) -> Lease:
        return Lease(self, key)


@dataclass
class Lease:
    """One HTTP request's share of its key's cap."""

    leases: KeyLeases
    key: str
    count: int = 0

    def take(self, n: int) -> None:
        """Hold `n` more; 429 (OpenAI's rate-limit shape, Retry-After) if the key would hold more than the cap,
        400 if `n` alone is more."""
        limit, held = self.leases.limit, self.leases.held.get(self.key, 0)
        if not limit:
            return
        if n > limit:
            raise APIError(400, f"The request has {n} prompts; an API key may have at most {limit} requests "
                                "waiting or running (max_requests_per_key).", param="prompt")
        if held + n > limit:
            raise APIError(429, f"This API key has {held} requests waiting or running; at most {limit} are "
                                "allowed at once (max_requests_per_key): retry when one has finished.",
                           type="requests", code="rate_limit_exceeded", headers={"Retry-After": str(RETRY_AFTER_S)})
        self.leases.held[self.key] = held + n
        self.count += n

    def release(self) -> None:
        if self.count:
            left = self.leases.held.get(self.key, 0) - self.count
            if left > 0:
                self.leases.held[self.key] = left
            else:
                self.leases.held.pop(self.key, None)
            self.count = 0


class LogprobBudget:
    """The logprob entries all admitted requests together may keep on the host (`total`; 0: no budget): each holds
    what `RequestLimits.check_logprobs` counts from its admission until its response has ended (answered, failed,
    or its client gone: the middleware releases its `holds`). Event-loop thread only."""

    def __init__(self, total: int) -> None:
        if total < 0:
            raise ValueError(f"logprob_budget must be >= 0, got {total}.")
        self.total, self.held = total, 0

    def take(self, entries: int, holds: list[LogprobHold], param: str) -> None:
        """Hold `entries` until `holds` are released; 429 (Retry-After) while the others hold too much for them,
        400 if they exceed the whole budget (naming `param`)."""
        if not self.total or not entries:
            return
        if entries > self.total:
            raise APIError(400, f"The request would keep {entries} logprobs on the server; all requests together "
                                f"may keep at most {self.total} (logprob_budget): lower max_tokens, n or the "
                                "logprobs.", param=param)
        if self.held + entries > self.total:
            raise APIError(429, f"The server's requests keep {self.held} logprobs of the {self.total} they may "
                                f"(logprob_budget), and this one would keep {entries}: retry when others have "
                                "finished, or ask for fewer.", type="requests", code="rate_limit_exceeded",
                           headers={"Retry-After": str(RETRY_AFTER_S)})
        self.held += entries
        holds.append(LogprobHold(self, entries))


@dataclass
class LogprobHold:
    """One request's share of the `LogprobBudget`."""

    budget: LogprobBudget
    entries: int

    def release(self) -> None:
        self.budget.held -= self.entries
        self.entries = 0


def check_prompt_logprobs(prompt_lens: list[int], params: SamplingParams, copies: int) -> None:
    """400 unless the response's prompt logprobs, `copies` times each prompt's positions x (k + 1) entries (a
    completion repeats them in every choice, twice with echo and prompt_logprobs), stay within
    MAX_PROMPT_LOGPROB_ENTRIES."""
    if params.prompt_logprobs is None:
        return
    entries = copies * sum(prompt_lens) * (params.prompt_logprobs + 1)
    if entries > MAX_PROMPT_LOGPROB_ENTRIES:
        raise APIError(400, f"The response would hold {entries} prompt logprobs ({copies} copies of "
                            f"{sum(prompt_lens)} prompt tokens x {params.prompt_logprobs + 1}); at most "
                            f"{MAX_PROMPT_LOGPROB_ENTRIES} are allowed: lower n, the logprobs or the prompt.",
                       param="prompt_logprobs" if params.n == 1 else "n")


def check_fan_out(num_prompts: int, req: P.SamplingRequest, max_prompts_per_request: int) -> None:
    """400 unless prompts x n (or beam_width) is within max_prompts_per_request."""
    width = (req.beam_width or req.n) if req.use_beam_search else req.n
    if num_prompts * width > max_prompts_per_request:
        raise APIError(400, f"The request asks for {num_prompts} prompts x {width} sequences; at most "
                            f"{max_prompts_per_request} are allowed per request (max_prompts_per_request).",
                       param="n" if num_prompts == 1 else "prompt")
