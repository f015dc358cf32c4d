"""llama.cpp's speculative decoding beside pagedlm's (`pagedlm bench speculative --llama-cpp`): llama-cpp-python
(the optional extra) on the same GGUF and the same prompt token ids, greedy, one stream, without a draft and with
its prompt lookup (`LlamaPromptLookupDecoding`: n-grams of up to 2 tokens, `num_pred_tokens` drafted; 10 is its
default, 2 its suggestion for CPUs). Like pagedlm's prefix cache, llama.cpp reuses the K/V of the prompt it last
saw (no reset between runs)."""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

LOOKUPS = (10, 2)  # num_pred_tokens of the lookup sides


@dataclass
class Counted:
    """A draft model that counts its drafts: calls (one per verifying step) and tokens proposed."""

    inner: object
    calls: int = 0
    tokens: int = 0

    def __call__(self, input_ids, /, **kwargs):
        draft = self.inner(input_ids, **kwargs)
        self.calls += 1
        self.tokens += len(draft)
        return draft


class LlamaCppSides:
    """llama.cpp without a draft, and with prompt lookup for each of LOOKUPS (one model, its draft swapped)."""

    def __init__(self, path: Path, n_threads: int, n_ctx: int = 4096) -> None:
        import llama_cpp  # optional extra
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        if Path(path).is_dir():
            raise ValueError("--llama-cpp needs a .gguf model")
        self._eog = lambda llm, t: llama_cpp.llama_vocab_is_eog(llm._model.vocab, t)
        kw = dict(model_path=str(path), n_ctx=n_ctx, n_batch=512, verbose=False, n_threads=n_threads)
        self.plain = llama_cpp.Llama(**kw)
        self.lookups = {n: Counted(LlamaPromptLookupDecoding(num_pred_tokens=n)) for n in LOOKUPS}
        self.drafting = llama_cpp.Llama(**kw, draft_model=self.lookups[LOOKUPS[0]])  # keeps logits for every row
        self.sides = ["llama.cpp", *(f"llama.cpp lookup {n}" for n in LOOKUPS)]

    def run(self, side: str, prompt: list[int], max_tokens: int) -> dict:
        """One greedy answer of at most `max_tokens` tokens (stopping at an end-of-generation token)."""
        draft = self.lookups[int(side.rsplit(" ", 1)[1])] if side != "llama.cpp" else None
        llm = self.plain if draft is None else self.drafting
        if draft is not None:
            llm.draft_model, draft.calls, draft.tokens = draft, 0, 0
        out: list[int] = []
        t0 = time.perf_counter()
        for t in llm.generate(prompt, temp=0.0, top_k=1):
            if self._eog(llm, t):
                break
            out.append(t)
            if len(out) >= max_tokens:
                break
        seconds = time.perf_counter() - t0
        accepted = max(0, len(out) - draft.calls) if draft is not None else 0  # each step: its accepted + 1
        return dict(tokens=out, seconds=seconds, drafts=draft.tokens if draft else 0, accepted=accepted)
