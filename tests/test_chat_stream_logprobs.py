"""A streamed chat answer's logprobs, however the engine's outputs merge: the engine sends each token when it is
sampled but holds back the text of an incomplete character (and of what could still become a stop string), and a
consumer that falls behind takes several outputs as one (`merge_outputs`); each chunk must still carry the logprobs
of exactly the tokens whose text it carries (the Responses API's text deltas and Ollama's lines are built from these
chunks)."""
from __future__ import annotations

import asyncio
import itertools
from types import SimpleNamespace

from conftest import build_tiny_tokenizer

from pagedlm.engine.protocol import CompletionDelta, EngineOutput, merge_outputs
from pagedlm.hub.tokenizer import Tokenizer
from pagedlm.outputs import Logprob
from pagedlm.sampling.detokenizer import IncrementalDetokenizer
from pagedlm.server import protocol as P
from pagedlm.server.endpoints.chat import ChatEndpoint


class ReplayedStream:
    """A request's stream that gives `outputs` one after the other."""

    def __init__(self, outputs: list[EngineOutput]) -> None:
        self.outputs, self.finished = list(outputs), False

    async def next_latest(self) -> EngineOutput:
        out = self.outputs.pop(0)
        self.finished = out.finished
        return out


def engine_steps(tok, prompt: list[int], ids: list[int]) -> list[EngineOutput]:
    """One output per sampled token, as the engine makes them: its text from the incremental detokenizer (held
    back while it ends in an incomplete character; the rest released at the end), its logprob entry."""
    detok, steps = IncrementalDetokenizer(tok, prompt), []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        text = detok.append(t) + (detok.flush() if last else "")
        delta = CompletionDelta(0, [t], text, [{t: Logprob(-1.0 - i, 1, tok.decode([t]))}], None,
                                "length" if last else None)
        steps.append(EngineOutput("r", [delta], last, prompt_token_ids=prompt if i == 0 else None))
    return steps


def test_each_chunk_carries_the_logprobs_of_the_tokens_whose_text_it_carries():
    hf = build_tiny_tokenizer()
    lone = hf.encode("é", add_special_tokens=False)[-1]  # a continuation byte: U+FFFD alone, held until the next
    ids = [*hf.encode("hé日", add_special_tokens=False), lone, *hf.encode("el", add_special_tokens=False)]
    prompt = hf.encode("<|im_start|>assistant\n", add_special_tokens=False)
    steps = engine_steps(hf, prompt, ids)
    assert "".join(s.outputs[0].text for s in steps) == hf.decode(ids) == "hé日\ufffdel"
    endpoint = ChatEndpoint(SimpleNamespace(input_processor=SimpleNamespace(tokenizer=Tokenizer(hf))), "tiny")
    req = P.ChatCompletionRequest(model="tiny", messages=[{"role": "user", "content": "Hi"}], logprobs=True,
                                  top_logprobs=0, stream=True)

    async def chunks(outputs: list[EngineOutput]) -> list[P.ChatCompletionChunk]:
        params = endpoint._chat_params(req)
        return [c async for c in endpoint._chat_chunks(req, "r", [ReplayedStream(outputs)], params, len(prompt))]

    for cuts in itertools.product((False, True), repeat=len(ids) - 1):  # every way the outputs may merge
        bounds = [0, *(i + 1 for i, cut in enumerate(cuts) if cut), len(ids)]
        merged = [merge_outputs(steps[a:b]) for a, b in zip(bounds, bounds[1:])]
        sent = [c.choices[0] for c in asyncio.run(chunks(merged))[1:] if c.choices[0].logprobs]
        assert [e.logprob for c in sent for e in c.logprobs.content] == [-1.0 - i for i in range(len(ids))]
        assert "".join(c.delta.content for c in sent) == hf.decode(ids)
        got, start = [], 0
        for c in sent:  # the chunk's tokens are the next ones, and their text is the chunk's
            n = len(c.logprobs.content)
            got.append((hf.decode(ids[start:start + n]), c.delta.content))
            start += n
        assert all(text == content for text, content in got), (cuts, got)
