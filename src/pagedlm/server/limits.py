"""Per-request bounds the server checks before any work (see README, *Limits and security*)."""
from __future__ import annotations

from pagedlm.sampling.params import SamplingParams
from pagedlm.server import MAX_PROMPT_LOGPROB_ENTRIES
from pagedlm.server.protocol import APIError


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
