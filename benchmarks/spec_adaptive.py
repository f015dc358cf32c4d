"""The adaptive draft length's constants (spec/state.py) measured: prompt lookup on a repetitive workload (a summary
that quotes its document, greedy) and a non-repetitive one (open chat, sampled), each setting against drafting off,
single stream on one engine, runs alternated (off, then each setting), medians.

A setting is `MIN_TAIL_ACCEPTANCE/PAUSE_STEPS/DECAY`, or `fixed` (adaptive off: always k tokens when a match exists).

On a shared machine each repetition (one run of every setting) waits for a quiet CPU and is kept only if the other
processes used less than `--max-other` of a core while it ran (/proc/stat less this process's own CPU time); the
repetitions dropped are counted.

    .venv/bin/python benchmarks/spec_adaptive.py --repeats 5 --settings 0.2/8/0.8,0.1/8/0.8,0.35/8/0.8,fixed
"""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace

from pagedlm.bench.common import format_table, median
from pagedlm.bench.speculative import WORKLOADS
from pagedlm.config import SpeculativeConfig
from pagedlm.engine.spec_decode import SpecDecoder
from pagedlm.llm import LLM
from pagedlm.sampling.params import SamplingParams
from pagedlm.spec import state

CHAT = "User: Write a short story about a lighthouse keeper.\nAssistant:"


def workloads(output_len: int) -> dict[str, tuple[str, callable]]:
    quote = next(w for w in WORKLOADS if w.name.startswith("quote"))
    return {"repetitive (quote, greedy)": (quote.prompt, lambda seed: SamplingParams(
                temperature=0.0, max_tokens=output_len, ignore_eos=True)),
            "non-repetitive (chat, T=1)": (CHAT, lambda seed: SamplingParams(
                temperature=1.0, top_p=0.95, max_tokens=output_len, ignore_eos=True, seed=seed))}


def apply(setting: str, spec: SpeculativeConfig) -> SpeculativeConfig | None:
    """Set spec/state.py's constants for `setting`; the config to run with (None: drafting off)."""
    if setting == "off":
        return None
    if setting == "fixed":
        return replace(spec, adaptive=False)
    tail, pause, decay = setting.split("/")
    state.MIN_TAIL_ACCEPTANCE, state.PAUSE_STEPS, state.DECAY = float(tail), int(pause), float(decay)
    return spec


def run(llm: LLM, prompt: str, params: SamplingParams, config: SpeculativeConfig | None) -> dict:
    engine = llm.engine
    engine.spec = SpecDecoder(config, engine.max_model_len)
    t0 = time.perf_counter()
    out = llm.generate(prompt, params, use_tqdm=False)[0].outputs[0]
    seconds = time.perf_counter() - t0
    st = engine.spec.stats
    return dict(tok_s=len(out.token_ids) / seconds, drafts=st.num_draft_tokens, accepted=st.num_accepted_tokens)


def busy_seconds() -> float:
    """CPU seconds the whole machine spent busy since boot (/proc/stat)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")


def own_seconds() -> float:
    t = os.times()
    return t.user + t.system


def others(seconds: float) -> float:
    """Cores the other processes kept busy over the next `seconds`."""
    b, o = busy_seconds(), own_seconds()
    time.sleep(seconds)
    return max(0.0, (busy_seconds() - b) - (own_seconds() - o)) / seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    ap.add_argument("--settings", default="0.2/8/0.8,fixed")
    ap.add_argument("--max-other", type=float, default=0.1, help="cores the other processes may use during a kept "
                    "repetition (a negative value: keep every repetition)")
    ap.add_argument("--output-json")
    args = ap.parse_args()
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=args.k)
    llm = LLM(args.model, speculative_config=spec)
    settings = ["off", *args.settings.split(",")]
    rows = []
    for name, (prompt, params) in workloads(args.output_len).items():
        for s in settings:  # warm-up
            run(llm, prompt, params(0), apply(s, spec))
        rates: dict[str, list[float]] = {s: [] for s in settings}
        counts = {s: [0, 0] for s in settings}
        rep = dropped = 0
        while rep < args.repeats:
            while args.max_other >= 0 and others(3.0) > args.max_other:
                time.sleep(5)
            b, o, t0 = busy_seconds(), own_seconds(), time.perf_counter()
            results = {s: run(llm, prompt, params(1000 + rep), apply(s, spec)) for s in settings}
            other = ((busy_seconds() - b) - (own_seconds() - o)) / (time.perf_counter() - t0)
            if args.max_other >= 0 and other > args.max_other:
                dropped += 1
                continue
            for s, r in results.items():
                rates[s].append(r["tok_s"])
                counts[s][0] += r["drafts"]
                counts[s][1] += r["accepted"]
            rep += 1
        print(f"{name}: {dropped} repetitions dropped (other processes busy)", flush=True)
        base = median(rates["off"])
        for s in settings:
            d, a = counts[s]
            rows.append(dict(workload=name, setting=s, tok_s=median(rates[s]), ratio=median(rates[s]) / base,
                             drafts=d / args.repeats, acceptance=a / d if d else 0.0))
    print(format_table(rows, [("workload", "workload", ""), ("setting", "tail/pause/decay", ""),
                              ("tok_s", "tok/s", ".1f"), ("ratio", "vs off", ".3f"),
                              ("drafts", "draft tok/run", ".0f"), ("acceptance", "accepted", ".0%")]))
    print(f"load average at the end: {os.getloadavg()}")
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(dict(args=vars(args), rows=rows), f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
