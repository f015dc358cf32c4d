"""`ServedModel`: one served model's OpenAI endpoints together (completions.py, chat.py, tokenize.py, embed.py,
over the steps they share in base.py). The frontend resolves a request's model name to one."""
from __future__ import annotations

from pagedlm.server.endpoints.chat import ChatEndpoint
from pagedlm.server.endpoints.completions import CompletionsEndpoint
from pagedlm.server.endpoints.embed import EmbedEndpoint
from pagedlm.server.endpoints.tokenize import TokenizeEndpoint


class ServedModel(CompletionsEndpoint, ChatEndpoint, TokenizeEndpoint, EmbedEndpoint):
    """A served model: `completions`, `chat_completions` (each returns a `Result`: results.py, rendered by
    render.py), `tokenize`, `detokenize`, `tokenizer_info`, `chat_prompt`, `model_card`, `embed`. The endpoints
    share this one object, so each one's private methods carry its name (`_chat_choice`, `_completion_choice`)."""
