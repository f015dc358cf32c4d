"""`pagedlm chat [MODEL]`: a conversation in the terminal (as `ollama run` and `llama-cli -cnv` hold one). Each line
read is a user turn; the answer streams as the engine writes it, and the conversation (rendered with the model's chat
template, as the server renders it) grows turn by turn, its prefix found again in the prefix cache. `/clear` starts
over, `/bye` (or the end of input) ends, Ctrl-C stops an answer, and a line that begins with three double quotes
opens a turn of several lines, up to the line that ends with them. Input that is not a terminal is read line by line,
each line a turn, so a conversation can be piped in."""
from __future__ import annotations

import argparse
import itertools
import sys
import threading
from collections.abc import Iterator
from typing import TextIO

from pagedlm.engine.chat import render_chat
from pagedlm.sampling.params import SamplingParams

HELP = '/clear: forget the conversation; /bye: quit; Ctrl-C: stop an answer; """ begins and ends several lines'


def stream(engine, request_id: str, prompt: list[int], params: SamplingParams) -> Iterator[str]:
    """The answer's text as the engine writes it; the request is aborted if the caller stops early."""
    engine.add_request(request_id, prompt, params)
    done = False
    try:
        while not done:
            for out in engine.step():
                if out.request_id != request_id:
                    continue
                if out.error is not None:
                    raise RuntimeError(out.error.message)
                yield "".join(d.text for d in out.outputs)
                done = out.finished
    finally:
        if not done:
            engine.abort_request([request_id])


def converse(engine, params: SamplingParams, lines: TextIO, out: TextIO, system: str | None = None,
             interactive: bool = False) -> int:
    """Answer each line of `lines` as the next user turn of one conversation, writing the answers to `out`."""
    tok = engine.tokenizer
    start = [{"role": "system", "content": system}] if system else []
    history = list(start)
    ids = itertools.count()
    if interactive:
        out.write(f"{HELP}\n")
    while True:
        if interactive:
            out.write(">>> ")
            out.flush()
        try:
            line = lines.readline()
        except KeyboardInterrupt:
            out.write(f"\n{HELP}\n")
            continue
        if not line or line.strip() == "/bye":
            return 0
        text = line.rstrip("\n")
        if text.startswith('"""'):  # a turn of several lines, as `ollama run` takes one: up to a closing """
            text = _block(text[3:], lines, out if interactive else None)
        if text.strip() == "/clear":
            history = list(start)
            out.write("(the conversation is cleared)\n")
            continue
        if not text.strip():
            continue
        history.append({"role": "user", "content": text})
        answer = []
        try:
            prompt = tok.encode(render_chat(tok, history), add_special_tokens=False)
            for piece in stream(engine, f"chat-{next(ids)}", prompt, params):
                answer.append(piece)
                out.write(piece)
                out.flush()
        except KeyboardInterrupt:  # the request is aborted; what was said stays in the conversation
            if not interactive:
                raise
        out.write("\n\n" if interactive else "\n")
        history.append({"role": "assistant", "content": "".join(answer)})


def _block(first: str, lines: TextIO, out: TextIO | None) -> str:
    """The lines from `first` up to the one that ends with \"\"\" (or the end of input), without the quotes."""
    parts, line = [], first
    while True:
        if line.rstrip("\n").endswith('"""'):
            parts.append(line.rstrip("\n")[:-3])
            return "\n".join(parts).strip("\n")
        parts.append(line.rstrip("\n"))
        if out is not None:
            out.write("... ")
            out.flush()
        line = lines.readline()
        if not line:
            return "\n".join(parts).strip("\n")


def cmd_chat(args: argparse.Namespace, engine_kwargs) -> int:
    from pagedlm.engine.llm_engine import LLMEngine

    kwargs = engine_kwargs(args)
    if args.model_tag:
        kwargs["model"] = args.model_tag
    engine = LLMEngine.from_args(**kwargs)
    # the chat template's tokenizer (transformers, seconds to import) loads while the first line is typed
    threading.Thread(target=lambda: engine.tokenizer.hf, daemon=True).start()
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            max_tokens=args.max_tokens)
    return converse(engine, params, sys.stdin, sys.stdout, args.system, interactive=sys.stdin.isatty())


def add_chat_parser(sub, engine_args_fn, engine_kwargs_fn) -> None:
    p = sub.add_parser("chat", help="hold a conversation with a model in the terminal")
    p.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model (as --model)")
    engine_args_fn(p)
    p.add_argument("--system", default=None, help="a system message to start the conversation with")
    p.add_argument("--max-tokens", type=int, default=1024, help="the most tokens one answer may have")
    p.add_argument("--temperature", type=float, default=0.7)
    p.add_argument("--top-p", type=float, default=0.9)
    p.add_argument("--top-k", type=int, default=-1)
    p.set_defaults(fn=lambda args: cmd_chat(args, engine_kwargs_fn))
