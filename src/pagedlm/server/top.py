"""`pagedlm top [URL]`: the memory view in a terminal (like htop), for people on SSH. It polls the server's
GET /debug/state (the same JSON as the web view at /ui) and draws the same panels with `rich`: the block pool, the
sequences' block tables (shared blocks marked), live rates and latencies, counters, the router's decisions and the
MoE expert heatmap."""
from __future__ import annotations

import argparse
import json
import os
import time
import urllib.error
import urllib.request
from collections import deque

from rich.console import Console, Group
from rich.live import Live
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from pagedlm.server.options import API_KEY_ENV

SPARK = "▁▂▃▄▅▆▇█"
HEAT = " ░▒▓█"
STYLES = {0: ("·", "grey35"), 2: ("▪", "blue"), 1: ("■", "green")}  # free, cached, in use
SHARED = ("■", "dark_orange")
HISTORY = 60


def expand_runs(runs: list[int]) -> list[int]:
    return [v for i in range(0, len(runs), 2) for v in [runs[i]] * runs[i + 1]]


def fetch_state(url: str, api_key: str | None, timeout: float = 10.0) -> dict:
    """GET {url}/debug/state; RuntimeError with the server's message on an error status."""
    req = urllib.request.Request(url.rstrip("/") + "/debug/state",
                                 headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        hint = {401: " (give --api-key or $PAGEDLM_API_KEY)", 404: " (is the server run with --ui?)"}
        raise RuntimeError(f"{url}/debug/state: HTTP {e.code}{hint.get(e.code, '')}") from None
    except urllib.error.URLError as e:
        raise RuntimeError(f"cannot reach {url}: {e.reason}") from None


def tree_prefixes(seqs: list[dict]) -> list[str]:
    """Each sequence's tree glyphs, for sequences in the snapshot's tree order (a parent before its children):
    '' for a root, else one '│  ' or '   ' per ancestor below the root and '├─ ' or '└─ ' for itself."""
    left: dict[int, int] = {}  # parent seq_id -> children not drawn yet
    for s in seqs:
        if s.get("parent") is not None:
            left[s["parent"]] = left.get(s["parent"], 0) + 1
    below: dict[int, str] = {}  # seq_id -> what its children's glyphs start with
    out = []
    for s in seqs:
        parent = s.get("parent")
        if parent is None or parent not in below:
            below[s["seq_id"]] = ""
            out.append("")
            continue
        left[parent] -= 1
        last = left[parent] == 0
        out.append(below[parent] + ("└─ " if last else "├─ "))
        below[s["seq_id"]] = below[parent] + ("   " if last else "│  ")
    return out


def sparkline(values: list[float | None], width: int = 30) -> str:
    vals = [v for v in values[-width:]]
    finite = [v for v in vals if v is not None]
    top = max(finite, default=0) or 1.0
    return "".join(" " if v is None else SPARK[min(len(SPARK) - 1, int(v / top * (len(SPARK) - 1)))] for v in vals)


class TopView:
    """Renders states of /debug/state; keeps the history the rates and sparklines need."""

    def __init__(self, model: str | None = None, replica: str | None = None, width: int = 100) -> None:
        self.model, self.replica, self.width = model, replica, width
        self.history: deque[dict] = deque(maxlen=HISTORY)
        self.prev_moe: dict | None = None

    def select(self, state: dict) -> tuple[str, str]:
        """The model and replica to show: the chosen ones (ValueError naming those there are when absent), else
        the first."""
        models = state["models"]
        if self.model is not None and self.model not in models:
            raise ValueError(f"the server has no model {self.model!r}; its models: {', '.join(models)}")
        name = self.model if self.model is not None else next(iter(models))
        replicas = models[name]["replicas"]
        if self.replica is not None and self.replica not in replicas:
            raise ValueError(f"model {name!r} has no replica {self.replica!r}; its replicas: {', '.join(replicas)}")
        return name, self.replica if self.replica is not None else next(iter(replicas))

    def render(self, state: dict) -> Group:
        models = state["models"]
        name, rep = self.select(state)
        m = models[name]
        snap = m["replicas"][rep]
        title = Text(f"pagedlm top · {name}" + (f" · replica {rep}" if len(m["replicas"]) > 1 else "")
                     + f" · {time.strftime('%H:%M:%S', time.localtime(state['time']))}", style="bold")
        if len(models) > 1:
            title.append(f"   (models: {', '.join(models)})", style="dim")
        parts: list = [title]
        if "error" in snap:
            parts.append(Text(f"{name}: {snap['error']}", style="red"))
        else:
            self._record(snap, m["latency"])
            parts += [self.pool_panel(snap), self.seqs_panel(snap), self.live_panel(snap)]
            if snap["moe_expert_tokens"]:
                parts.append(self.moe_panel(snap))
        if state.get("router"):
            parts.append(self.router_panel(state["router"]))
        return Group(*parts)

    def _record(self, snap: dict, latency: dict) -> None:
        c = snap["counters"]
        point = {"t": snap["time"], "gen": c["generation_tokens"], "prompt": c["prompt_tokens"],
                 "usage": snap["device"]["num_used"] / max(1, snap["device"]["num_blocks"]),
                 "ttft": latency["ttft_ms"], "tpot": latency["tpot_ms"], "gen_rate": None, "prompt_rate": None}
        if self.history and point["t"] > self.history[-1]["t"]:
            prev, dt = self.history[-1], point["t"] - self.history[-1]["t"]
            point["gen_rate"] = max(0.0, (point["gen"] - prev["gen"]) / dt)
            point["prompt_rate"] = max(0.0, (point["prompt"] - prev["prompt"]) / dt)
        self.history.append(point)

    def pool_panel(self, snap: dict) -> Panel:
        pool = snap["device"]
        states, refs = expand_runs(pool["state_runs"]), expand_runs(pool["ref_runs"])
        shared = sum(r > 1 for r in refs)
        cols = max(8, self.width - 4)
        shown = min(len(states), cols * 8)  # at most 8 lines of blocks
        grid = Text()
        for b in range(shown):
            ch, style = SHARED if refs[b] > 1 else STYLES[states[b]]
            grid.append(ch, style=style)
            if (b + 1) % cols == 0 and b + 1 < shown:
                grid.append("\n")
        if shown < len(states):
            grid.append(f"\n… {len(states) - shown} more blocks", style="dim")
        legend = Text.assemble(("■", "green"), " in use  ", SHARED, f" shared ({shared})  ", ("▪", "blue"),
                               " cached  ", ("·", "grey35"), " free")
        title = (f"KV block pool: {pool['num_blocks']} blocks of {snap['block_size']} tokens ({snap['kv_dtype']}) · "
                 f"{pool['num_used']} in use · {pool['num_cached']} cached · {pool['num_free']} free")
        host = snap.get("host")
        lines = [grid, legend]
        if host:
            lines.append(Text(f"host swap space: {host['num_used']} of {host['num_blocks']} blocks in use", "dim"))
        return Panel(Group(*lines), title=title, title_align="left")

    def seqs_panel(self, snap: dict, max_rows: int = 16) -> Panel:
        refs = expand_runs(snap["device"]["ref_runs"])
        table = Table(expand=True, box=None, pad_edge=False)
        for col in ("sequence (@ forked at token)", "status", "tokens", "blocks (shared in orange)"):
            table.add_column(col, no_wrap=True, overflow="ellipsis", ratio=3 if col.startswith("blocks") else None)
        for s, tree in list(zip(snap["seqs"], tree_prefixes(snap["seqs"])))[:max_rows]:
            cells = Text()
            for b in (s["block_tables"][0] if s["block_tables"] else [])[:64]:
                on_device = s["status"] != "swapped" and b >= 0
                cells.append(f"{b} ", style="dark_orange" if on_device and refs[b] > 1 else "green" if b >= 0
                             else "grey35")
            if s.get("text"):
                cells.append(f"| {s['text']}", style="dim")
            label = Text(f"{s['request_id']} #{s['index']}") if not tree else Text.assemble(
                (tree, "grey50"), f"#{s['index']}", (f" @{s['forked_at']}", "dim"))
            table.add_row(label, s["status"] + (" · opaque" if s["opaque"] else ""),
                          f"{s['num_computed_tokens']}/{s['num_tokens']}", cells)
        q = snap["queues"]
        title = (f"Sequences: {len(snap['seqs'])} · running {q['running']} · waiting {q['waiting']} · "
                 f"swapped {q['swapped']}" + (f" (first {max_rows})" if len(snap["seqs"]) > max_rows else ""))
        return Panel(table, title=title, title_align="left")

    def live_panel(self, snap: dict) -> Panel:
        h = list(self.history)
        c, mem = snap["counters"], snap["memory"]
        rows = [("KV usage", [p["usage"] * 100 for p in h], "{:.1f} %"),
                ("generation", [p["gen_rate"] for p in h], "{:.1f} tok/s"),
                ("prompt", [p["prompt_rate"] for p in h], "{:.1f} tok/s"),
                ("TTFT", [p["ttft"] for p in h], "{:.1f} ms"), ("TPOT", [p["tpot"] for p in h], "{:.1f} ms")]
        live = Table(box=None, show_header=False, pad_edge=False)
        for name, values, f in rows:
            last = values[-1] if values else None
            live.add_row(name, Text(sparkline(values), "cyan"), "–" if last is None else f.format(last))
        hits = f"{c['prefix_hits']}/{c['prefix_queries']} tokens hit" if snap["prefix_caching"] else "off"
        counters = Table(box=None, show_header=False, pad_edge=False)
        for k, v in (("preemptions", c["preemptions"]), ("copy-on-write blocks", c["cow_blocks"]),
                     ("swapped out / in", f"{c['swapped_out_blocks']} / {c['swapped_in_blocks']}"),
                     ("prefix cache", hits), ("prefix evictions", c["prefix_evictions"]),
                     ("weights / KV / RSS", " / ".join(_bytes(mem[k]) for k in ("weights", "kv_cache", "host_rss")))):
            counters.add_row(k, str(v))
        d = snap.get("draft")
        if d:  # speculative decoding's draft model: its own weights and KV cache
            counters.add_row("draft weights / KV", f"{_bytes(d['weights'])} / {_bytes(d['kv_cache'])}")
            counters.add_row("draft KV blocks", f"{d['num_used']}/{d['num_blocks']} used · {d['num_seqs']} seqs")
        grid = Table.grid(expand=True, padding=(0, 2))
        grid.add_row(live, counters)
        return Panel(grid, title="Live", title_align="left")

    def moe_panel(self, snap: dict) -> Panel:
        moe = {int(k): v for k, v in snap["moe_expert_tokens"].items()}
        prev, self.prev_moe = self.prev_moe, moe
        delta = {k: [x - (prev or {}).get(k, [0] * len(v))[i] for i, x in enumerate(v)] for k, v in moe.items()}
        data = delta if any(any(v) for v in delta.values()) else moe
        text = Text()
        for layer in sorted(data):
            row = data[layer]
            top = max(row) or 1
            text.append(f"layer {layer:>3} ")
            text.append("".join(HEAT[min(len(HEAT) - 1, round(v / top * (len(HEAT) - 1)))] for v in row), "orange1")
            text.append("\n")
        return Panel(text, title="Experts (tokens per expert, since the last refresh)", title_align="left")

    def router_panel(self, router: dict) -> Panel:
        share = router["share"]
        pct = lambda v: "–" if v is None else f"{100 * v:.0f} %"  # noqa: E731
        title = (f"Router: {router['policy']} · threshold {_num(router['threshold'])} · strong "
                 f"{pct(share['realised_strong'])} (target {pct(share['target_strong'])})")
        if router.get("budget"):
            b = router["budget"]
            title += f" · spend ${b['spent']:.4g} of ${_num(b['cap_per_hour'])}/h"
        table = Table(expand=True, box=None, pad_edge=False)
        for col in ("time", "model", "tier", "score/threshold", "reason"):
            table.add_column(col, no_wrap=True, overflow="ellipsis")
        for d in router["decisions"][:8]:
            table.add_row(time.strftime("%H:%M:%S", time.localtime(d["time"])), d["model"], d["category"],
                          f"{_num(d['score'])}/{_num(d['threshold'])}", d["reason"])
        return Panel(table, title=title, title_align="left")


def _num(v: float | None) -> str:
    return "–" if v is None else f"{v:.3f}"


def _bytes(n: int | None) -> str:
    if n is None:
        return "–"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def run_top(url: str, api_key: str | None, interval: float, model: str | None = None, replica: str | None = None,
            iterations: int = 0, console: Console | None = None) -> int:
    """Redraw every `interval` seconds (at least 0.2) until interrupted, or `iterations` times (0: forever). An
    unreachable server is shown and retried; returns 1 if the last refresh failed, else 0. ValueError for a
    `model` or `replica` the server does not have."""
    console = console or Console()
    view = TopView(model, replica, console.width)
    interval, n, failed = max(0.2, interval), 0, False
    with Live(console=console, auto_refresh=False, screen=False) as live:
        try:
            while True:
                try:
                    view.width = console.width
                    live.update(view.render(fetch_state(url, api_key)), refresh=True)
                    failed = False
                except RuntimeError as e:
                    live.update(Text(str(e), style="red"), refresh=True)
                    failed = True
                n += 1
                if iterations and n >= iterations:
                    return int(failed)
                time.sleep(interval)
        except KeyboardInterrupt:
            return int(failed)


def add_top_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser("top", help="watch a server's KV cache, sequences, router and experts in the terminal")
    p.add_argument("url", nargs="?", default="http://127.0.0.1:8000", help="the server (default: %(default)s)")
    p.add_argument("--api-key", default=None, help=f"the server's API key (default: ${API_KEY_ENV})")
    p.add_argument("--interval", type=float, default=1.0, help="seconds between refreshes (default: %(default)s)")
    p.add_argument("--model", default=None, help="the served model to show (default: the first)")
    p.add_argument("--replica", default=None, help="with data parallelism, the replica to show (default: the first)")
    p.add_argument("--iterations", type=int, default=0, help="stop after this many refreshes (default: never)")
    p.set_defaults(fn=lambda a: run_top(a.url, a.api_key or os.environ.get(API_KEY_ENV, "").split(",")[0] or None,
                                        a.interval, a.model, a.replica, a.iterations))
    return p
