"""Speculative decoding against drafting off, single stream, alternated in one run on one engine (the same weights
and KV cache; only the drafting differs): code editing with a `prediction` (the original source, as an editor sends
it; and the model's own answer with one line changed, as from a model that makes just the edit asked for), a summary
that quotes its document with prompt lookup, and open-ended chat (little to copy) with prompt lookup. Greedy, so both
modes produce the same tokens (checked) and the comparison is tokens/s of the same text.

With `--speculative-config '{"method": "draft_model", ...}'` the draft model drafts in every workload (no
prediction) and the other side runs the same engine with drafting off.

With `--concurrency N`, each run sends N requests at once (the workload's prompt, each with a line of its own in
front) to the engine, which batches them as the server's would; tok/s is every request's tokens over the wall time.
Speculation pauses while more than `disable_by_batch_size` sequences run, so at N = 16 this measures what the
pause costs and, with a larger `disable_by_batch_size`, what drafting at that batch size would.

With `--llama-cpp` (a GGUF model, single stream), llama.cpp runs the same prompt tokens in the same alternation,
without a draft and with its prompt lookup (bench/speculative_llamacpp.py).

    pagedlm bench speculative --model smollm2-135m --repeats 3
    pagedlm bench speculative --concurrency 16 --speculative-config '{"method": "suffix", "num_speculative_tokens": 4}'
    pagedlm bench speculative --llama-cpp --repeats 5
    pagedlm bench speculative --dtype float32 --speculative-config \
        '{"method": "draft_model", "model": "smollm2-135m", "quantization": "int4", "num_speculative_tokens": 4}'
"""
from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch

from pagedlm.bench.common import format_table, median, write_json
from pagedlm.config import SpeculativeConfig
from pagedlm.engine.spec_decode import SpecDecoder
from pagedlm.llm import LLM
from pagedlm.sampling.params import SamplingParams
from pagedlm.spec.draft_model import DraftModel

CODE = '''def add(a, b):
    """Return the sum of a and b."""
    return a + b


def mean(values):
    """Return the arithmetic mean of a list of numbers."""
    if not values:
        raise ValueError("mean of an empty list")
    total = 0
    for v in values:
        total = add(total, v)
    return total / len(values)


def variance(values):
    """Return the population variance of a list of numbers."""
    m = mean(values)
    return mean([(v - m) ** 2 for v in values])
'''
ARTICLE = ("The paged key value cache stores the attention keys and values of every sequence in fixed size blocks. "
           "Blocks are allocated on demand as a sequence grows, and freed as soon as it finishes, so memory is not "
           "reserved for the longest possible answer. Sequences that share a prompt prefix share its blocks, and a "
           "block is copied only when one of them writes into it. The scheduler admits new requests while blocks "
           "remain, and preempts the newest request when they run out.")


@dataclass
class Workload:
    name: str
    prompt: str
    prediction: str | None = None  # with speculation: the request's prediction, else prompt lookup
    chat: bool = False  # the prompt is a user message, sent through the model's chat template
    one_line_edit: bool = False  # the prediction is the model's own answer with one line changed


EDIT = (f"Rename the function `add` to `plus` in this file and reply with the whole file, nothing else.\n\n"
        f"```python\n{CODE}```")
WORKLOADS = [
    # what a code editor sends: the file as the prediction (SmolLM2-135M rewrites more of it than asked)
    Workload("code-edit+prediction", EDIT, CODE, chat=True),
    # a model that makes exactly the edit asked for: the prediction is its answer with one line other
    Workload("code-edit-1-line+prediction", EDIT, chat=True, one_line_edit=True),
    # completion prompts: small models copy from them more reliably than they follow chat
    Workload("quote-summary+ngram", f"Article: {ARTICLE}\n\nThe article's key sentences, quoted, then a one-line "
                                    "summary:\n"),
    Workload("open-chat+ngram", "User: Write a short story about a lighthouse keeper.\nAssistant:"),
]


def prompts(w: Workload, concurrency: int, tok) -> list[list[int]]:
    """The workload's prompt token ids, once, or for `concurrency` requests each with a line of its own in front."""
    texts = [w.prompt] if concurrency == 1 else [f"Request {i + 1}.\n{w.prompt}" for i in range(concurrency)]
    if not w.chat:
        return [tok.encode(t) for t in texts]
    if not tok.has_chat_template:
        return [tok.encode(f"User: {t}\nAssistant:") for t in texts]
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": t}]), add_special_tokens=False)
            for t in texts]


def one_line_changed(text: str) -> str:
    """`text` with its middle non-blank line replaced by a `return None` at the same indentation."""
    lines = text.split("\n")
    filled = [i for i, line in enumerate(lines) if line.strip()]
    if not filled:
        return text + "\nreturn None"
    i = filled[len(filled) // 2]
    lines[i] = lines[i][:len(lines[i]) - len(lines[i].lstrip())] + "return None"
    return "\n".join(lines)


def predictions(llm: LLM, w: Workload, ids: list[list[int]], max_tokens: int) -> list[str | None]:
    """Each request's prediction: the workload's, or each greedy answer (drafting off) with one line changed."""
    if not w.one_line_edit:
        return [w.prediction] * len(ids)
    llm.engine.spec = SpecDecoder(None, llm.engine.max_model_len)
    outs = llm.generate(ids, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    return [one_line_changed(o.outputs[0].text) for o in outs]


def run_once(llm: LLM, ids: list[list[int]], preds: list[str | None], speculate: bool, spec: SpeculativeConfig,
             max_tokens: int, drafter: DraftModel | None) -> dict:
    """Greedy answers to every prompt in `ids` at once; with `speculate`, drafted from the predictions `preds`, by
    prompt lookup or by the draft model (a fresh SpecDecoder: its counters are this run's)."""
    engine = llm.engine
    with_prediction = speculate and spec.method != "draft_model" and preds[0] is not None
    engine.spec = SpecDecoder(spec if speculate and not with_prediction else None, engine.max_model_len, drafter)
    params = [SamplingParams(temperature=0.0, max_tokens=max_tokens, prediction=p if with_prediction else None)
              for p in preds]
    t0 = time.perf_counter()
    outs = llm.generate(ids, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    st = engine.spec.stats
    return dict(tokens=[o.outputs[0].token_ids for o in outs], seconds=seconds, drafts=st.num_draft_tokens,
                accepted=st.num_accepted_tokens)


def cmd_speculative(args: argparse.Namespace, engine_kwargs) -> int:
    kwargs = engine_kwargs(args)
    spec = kwargs.pop("speculative_config", None) or SpeculativeConfig(num_speculative_tokens=args.k)
    llm = LLM(**kwargs, speculative_config=spec)  # draft_model: loads the draft once, for every run
    drafter = llm.engine.spec.drafter
    peer = None
    if args.llama_cpp:
        if args.concurrency != 1:
            raise SystemExit("--llama-cpp compares single streams (--concurrency 1)")
        from pagedlm.bench.speculative_llamacpp import LlamaCppSides
        peer = LlamaCppSides(llm.engine.model_path, torch.get_num_threads())
    rows, peer_rows = [], []
    for w in WORKLOADS:
        times = {False: [], True: []}
        drafts = accepted = 0
        tokens: dict[bool, list[list[int]]] = {}
        sides = {s: dict(rates=[], drafts=0, accepted=0, tokens=0) for s in (peer.sides if peer else ())}
        batch = prompts(w, args.concurrency, llm.get_tokenizer())
        preds = predictions(llm, w, batch, args.output_len)
        run_once(llm, batch, preds, True, spec, 8, drafter)  # warm-up (kernels, caches)
        for side in sides:
            peer.run(side, batch[0], 8)
        for _ in range(args.repeats):
            for speculate in (False, True):
                r = run_once(llm, batch, preds, speculate, spec, args.output_len, drafter)
                times[speculate].append(sum(map(len, r["tokens"])) / r["seconds"])
                tokens[speculate] = r["tokens"]
                if speculate:
                    drafts, accepted = drafts + r["drafts"], accepted + r["accepted"]
            for side, acc in sides.items():
                r = peer.run(side, batch[0], args.output_len)
                acc["rates"].append(len(r["tokens"]) / r["seconds"])
                acc["drafts"], acc["accepted"] = acc["drafts"] + r["drafts"], acc["accepted"] + r["accepted"]
                acc["tokens"] = len(r["tokens"])
        base, fast = median(times[False]), median(times[True])
        source = "draft" if drafter is not None else "prediction" if preds[0] is not None else spec.method
        name = f"{w.name.split('+')[0]}+{source}"
        rows.append(dict(workload=name, concurrency=args.concurrency, tokens=sum(map(len, tokens[False])),
                         base=base, spec=fast, speedup=fast / base,
                         acceptance=accepted / drafts if drafts else 0.0, same=tokens[False] == tokens[True],
                         runs=dict(base=times[False], spec=times[True])))
        for side, acc in sides.items():
            rate = median(acc["rates"])
            peer_rows.append(dict(workload=name.split("+")[0], side=side, tokens=acc["tokens"], rate=rate,
                                  vs_base=rate / base, vs_spec=rate / fast,
                                  acceptance=acc["accepted"] / acc["drafts"] if acc["drafts"] else None,
                                  runs=acc["rates"]))
    print(format_table(rows, [("workload", "workload", ""), ("concurrency", "requests", "d"),
                              ("tokens", "out tok", "d"),
                              ("base", "off tok/s", ".1f"), ("spec", "spec tok/s", ".1f"),
                              ("speedup", "speedup", ".2f"), ("acceptance", "accepted", ".0%"),
                              ("same", "same output", "")]))
    if peer_rows:
        print(format_table(peer_rows, [("workload", "workload", ""), ("side", "llama.cpp", ""),
                                       ("tokens", "out tok", "d"), ("rate", "tok/s", ".1f"),
                                       ("vs_base", "/ pagedlm off", ".2f"), ("vs_spec", "/ pagedlm spec", ".2f"),
                                       ("acceptance", "accepted (about)", ".0%")]))
    write_json(args.output_json, dict(config=vars(spec) if spec else None, results=rows, llama_cpp=peer_rows))
    return 0 if all(r["same"] for r in rows) else 1
