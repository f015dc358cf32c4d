"""The OpenAI endpoints of one served model, one module each: completions.py, chat.py, tokenize.py (/tokenize,
/detokenize, /tokenizer_info), embed.py (its embeddings: pooled hidden states), over base.py (the prompt's checks,
the checks that bound the work, submission); logprobs.py (every logprob shape); results.py (an endpoint's typed
answer: `Answer` or `Stream`) and render.py (a result as JSON or SSE); model.py (`ServedModel`: all of them for one
model)."""
from pagedlm.server.endpoints.model import ServedModel
from pagedlm.server.endpoints.render import render
from pagedlm.server.endpoints.results import Answer, Result, Stream

__all__ = ["Answer", "Result", "ServedModel", "Stream", "render"]
