"""The memory views (issue 36): the engine snapshot's invariants against the block manager, /debug/state and /ui
behind the API key, the web view in a real headless Chromium, and `pagedlm top` under a pseudo-terminal."""
from __future__ import annotations

import asyncio
import fcntl
import os
import pty
import re
import select
import shutil
import struct
import subprocess
import sys
import termios
import threading
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from server_utils import InProcessServer, routed_server

from pagedlm.config import LoopConfig
from pagedlm.engine import snapshot as snapshot_mod
from pagedlm.engine.async_engine import AsyncLLMEngine
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.engine.sequence import Request, Sequence, SequenceStatus
from pagedlm.engine.snapshot import CACHED, FREE, USED, build_snapshot, expand_runs, run_lengths, seq_snapshots
from pagedlm.kvcache.block_manager import BlockManager
from pagedlm.sampling.params import SamplingParams
from pagedlm.server.api import build_app
from pagedlm.server.options import ServerConfig

KEY = "memview-key"
PREFIX = "The quick brown fox jumps over the lazy dog. A paged key value cache stores attention keys. " * 2


@given(st.lists(st.integers(0, 3), max_size=200))
def test_run_lengths_round_trip(values):
    runs = run_lengths(values)
    assert expand_runs(runs) == values
    assert all(runs[i] != runs[i + 2] for i in range(0, len(runs) - 2, 2))  # maximal runs


def check_invariants(bm: BlockManager, requests: list[tuple[str, Request]]) -> None:
    """The snapshot's pool and tables agree with the manager: ref counts equal, every reference is listed in an
    owner's table (a block with ref count r appears r times among the device tables), states follow."""
    pool = snapshot_mod.pool_snapshot(bm.gpu)
    seqs = seq_snapshots(requests, bm)
    refs, states = expand_runs(pool.ref_runs), expand_runs(pool.state_runs)
    assert refs == bm.gpu.ref_counts
    listed = Counter(b for s in seqs if s.status != "swapped" for t in s.block_tables for b in t if b >= 0)
    assert {b: r for b, r in enumerate(refs) if r} == dict(listed)
    if bm.cpu.num_blocks:  # swapped sequences' tables list host blocks
        host = snapshot_mod.pool_snapshot(bm.cpu)
        listed = Counter(b for s in seqs if s.status == "swapped" for t in s.block_tables for b in t)
        assert {b: r for b, r in enumerate(expand_runs(host.ref_runs)) if r} == dict(listed)
        assert host.num_used == sum(r > 0 for r in bm.cpu.ref_counts)
    for b, (state, r) in enumerate(zip(states, refs)):
        expected = USED if r else CACHED if bm.gpu.block_hash[b] is not None else FREE
        assert state == expected, (b, state, r)
    assert pool.num_used + pool.num_free + pool.num_cached == bm.gpu.num_blocks
    assert pool.num_free + pool.num_cached == bm.gpu.num_free
    for s in seqs:
        assert s.block_tables == bm.block_tables.get(s.seq_id, [])
    check_tree(seqs, requests)


def check_tree(seqs, requests: list[tuple[str, Request]], forks: dict[int, tuple[int, int]] | None = None) -> None:
    """Each request's sequences are listed as a tree: a parent is a listed sequence of the same request, before its
    children, and shares the child's first `forked_at` tokens. With `forks` (child -> (parent, tokens) as forked),
    the parent is the nearest live ancestor and `forked_at` the fewest tokens shared along the way."""
    live = {s.seq_id: s for _, r in requests for s in r.live_seqs}
    listed = {s.seq_id: (i, s) for i, s in enumerate(seqs)}
    for i, s in enumerate(seqs):
        if s.parent is None:
            assert s.forked_at == 0
            continue
        j, p = listed[s.parent]
        assert j < i and p.request_id == s.request_id
        assert live[s.seq_id].token_ids()[:s.forked_at] == live[s.parent].token_ids()[:s.forked_at]
    if forks is not None:
        for s in seqs:
            parent, at = forks.get(s.seq_id, (None, 0))
            while parent is not None and parent not in live:
                parent, shared = forks.get(parent, (None, 0))
                at = min(at, shared)
            assert (s.parent, s.forked_at) == (parent, at if parent is not None else 0)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 10**6)), max_size=40))
def test_snapshot_invariants_against_the_block_manager(ops):
    """Admissions sharing prefixes (prefix cache), forks, decoding (copy-on-write), swapping out and in, and frees
    in any order."""
    bm = BlockManager(48, 4, num_cpu_blocks=32, enable_prefix_caching=True)
    reqs: list[Request] = []
    prefixes = [list(range(100, 111)), list(range(200, 206))]
    forks: dict[int, tuple[int, int]] = {}  # child -> (parent, tokens shared), as forked
    for op, r in ops:
        live = [(req, s) for req in reqs for s in req.live_seqs if s.seq_id not in bm.swapped]
        if op == 4:  # swap a request out, or back in
            req = reqs[r % len(reqs)] if reqs else None
            seqs = req.live_seqs if req is not None else []
            if not seqs:
                continue
            if seqs[0].seq_id in bm.swapped:
                if bm.can_swap_in(seqs):
                    bm.swap_in(seqs)
            elif bm.can_swap_out(seqs):
                bm.swap_out(seqs)
        elif op == 0 or not live:  # admit a prompt: a shared prefix and a suffix of its own
            prompt = prefixes[r % 2] + [300 + r % 7] * (1 + r % 5)
            seq = Sequence(prompt, status=SequenceStatus.RUNNING)
            hits = bm.find_cached_prefix(seq)
            n = len(prompt) - len(hits) * 4
            if not bm.can_allocate([seq], [n], [hits]):
                continue
            seq.num_computed_tokens = len(hits) * 4
            req = Request(f"r{len(reqs)}", None, prompt, SamplingParams(), seqs=[seq])
            req.num_cached_tokens = len(hits) * 4
            bm.allocate(seq, n, hits)
            bm.commit(seq, len(prompt))
            seq.num_computed_tokens = len(prompt)
            reqs.append(req)
        else:
            req, seq = live[r % len(live)]
            if op == 1:  # fork
                child = Sequence(list(seq.prompt_token_ids), index=len(req.seqs), status=SequenceStatus.RUNNING)
                child.output_token_ids = list(seq.output_token_ids)
                child.num_computed_tokens = seq.num_computed_tokens
                child.parent_seq_id, child.forked_at = seq.seq_id, seq.num_tokens
                forks[child.seq_id] = (seq.seq_id, seq.num_tokens)
                bm.fork(seq, child)
                req.seqs.append(child)
            elif op == 2:  # decode one token
                seq.output_token_ids.append(r % 50)
                if not bm.can_append_slots([seq], [1]):
                    seq.output_token_ids.pop()
                    continue
                bm.append_slots(seq, 1)
                bm.commit(seq, seq.num_tokens)
                seq.num_computed_tokens = seq.num_tokens
            else:  # finish (a swapped sequence's host blocks are freed alike); beams drop their ended sequences
                if r % 3 == 0:
                    req, seq = next(((q, s) for q in reqs for s in q.live_seqs if s.seq_id in bm.swapped), (req, seq))
                seq.status = SequenceStatus.FINISHED_STOPPED
                bm.free(seq)
                if r % 2:
                    req.keep_seqs(req.live_seqs)
        check_invariants(bm, [("running", q) for q in reqs])
        check_tree(seq_snapshots([("running", q) for q in reqs], bm), [("running", q) for q in reqs], forks)
    for req in reqs:
        for seq in req.live_seqs:
            seq.status = SequenceStatus.FINISHED_STOPPED
            bm.free(seq)
    pool = snapshot_mod.pool_snapshot(bm.gpu)
    assert set(expand_runs(pool.state_runs)) <= {FREE, CACHED} and pool.num_used == 0
    assert snapshot_mod.pool_snapshot(bm.cpu).num_used == 0
    assert seq_snapshots([("running", q) for q in reqs], bm) == []


def test_forks_of_ended_sequences_hang_from_their_nearest_live_ancestor():
    """a -> b -> c and a -> d: when b ends, c is listed under a, sharing the fewer tokens of the two forks; whether
    b is kept among the request's sequences (n > 1 samples) or dropped (beams: `keep_seqs`)."""
    for drop in (False, True):
        bm = BlockManager(16, 4)
        a = Sequence(list(range(10, 19)), status=SequenceStatus.RUNNING)
        req = Request("r", None, a.prompt_token_ids, SamplingParams(), seqs=[a])
        bm.allocate(a, 9)
        a.num_computed_tokens = 9

        def fork(parent: Sequence, tokens: list[int]) -> Sequence:
            child = Sequence(list(parent.prompt_token_ids), index=len(req.seqs), status=SequenceStatus.RUNNING,
                             output_token_ids=list(parent.output_token_ids), num_computed_tokens=parent.num_tokens,
                             parent_seq_id=parent.seq_id, forked_at=parent.num_tokens)
            bm.fork(parent, child)
            req.seqs.append(child)
            child.output_token_ids += tokens
            return child

        b = fork(a, [1, 2])
        c = fork(b, [3])
        d = fork(a, [4])
        b.status = SequenceStatus.FINISHED_STOPPED
        bm.free(b)
        if drop:
            req.keep_seqs([a, c, d])
            assert req.seqs == [a, c, d] and (c.parent_seq_id, c.forked_at) == (a.seq_id, 9)
        seqs = seq_snapshots([("running", req)], bm)
        assert [(s.index, s.parent, s.forked_at) for s in seqs] == [(0, None, 0), (2, a.seq_id, 9),
                                                                    (3, a.seq_id, 9)]
        check_tree(seqs, [("running", req)])


def test_cached_blocks_found_from_either_side():
    """The snapshot finds cached blocks from the cached set or from the free list, whichever is smaller: both agree
    with the manager."""
    bm = BlockManager(8, 2, enable_prefix_caching=True)
    seq = Sequence(list(range(20, 34)), status=SequenceStatus.RUNNING)
    req = Request("r", None, seq.prompt_token_ids, SamplingParams(), seqs=[seq])
    bm.allocate(seq, 14)
    bm.commit(seq, 14)
    other = Sequence(list(range(50, 52)), status=SequenceStatus.RUNNING)
    bm.allocate(other, 2)  # the last free block
    bm.free(other)  # back to the free list, with no hash: free, not cached
    assert len(bm.gpu.cached) > bm.gpu.num_free  # the free-list side
    check_invariants(bm, [("running", req)])
    seq.status = SequenceStatus.FINISHED_STOPPED
    bm.free(seq)
    assert len(bm.gpu.cached) <= bm.gpu.num_free  # the cached-set side
    check_invariants(bm, [])
    pool = snapshot_mod.pool_snapshot(bm.gpu)
    assert (pool.num_cached, pool.num_free) == (7, 1) and expand_runs(pool.state_runs) == [CACHED] * 7 + [FREE]


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> LLMEngine:
    return LLMEngine.from_args(str(tiny_model_dir), dtype="float32", num_kv_blocks=96, block_size=8,
                               enable_prefix_caching=True, seed=0)


def test_engine_snapshot_through_forks_and_prefix_hits(engine):
    """n=4 with a shared prefix, and a second request reusing it: the invariants hold after every step, the
    forks' copy-on-write and the prefix hits are counted, and at the end every block is free or cached."""
    tok = engine.tokenizer
    prompt = tok.encode(PREFIX)
    forked = prompt + tok.encode(" one")
    engine.add_request("fork", forked, SamplingParams(n=4, max_tokens=12, temperature=1.0, seed=3, ignore_eos=True))
    started = build_snapshot(engine).counters
    steps = 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
        if steps == 3:
            engine.add_request("reuse", prompt + tok.encode(" two"), SamplingParams(max_tokens=4, ignore_eos=True))
        snap = build_snapshot(engine)
        requests = [("running", r) for r in engine.scheduler.running] + [("waiting", r) for r in
                                                                           engine.scheduler.waiting]
        check_invariants(engine.block_manager, requests)
        assert [s.seq_id for s in snap.seqs] == [s.seq_id for _, r in requests for s in r.live_seqs]
        if steps == 2:
            tables = [s.block_tables[0] for s in snap.seqs if s.request_id == "fork"]
            assert len(tables) == 4 and len(set(tables[0][:3])) == 3
            assert all(t[:3] == tables[0][:3] for t in tables)  # the prompt's blocks are in every owner's table
            root, *children = [s for s in snap.seqs if s.request_id == "fork"]
            assert root.parent is None and [c.index for c in children] == [1, 2, 3]
            assert {(c.parent, c.forked_at) for c in children} == {(root.seq_id, len(forked))}  # after the prefill
            assert snap.to_dict()["seqs"][1]["parent"] == root.seq_id
    end = build_snapshot(engine)
    assert end.seqs == [] and end.device.num_used == 0 and end.queues["running"] == 0
    assert set(expand_runs(end.device.state_runs)) == {FREE, CACHED} and end.device.num_cached > 0
    assert end.counters["cow_blocks"] > started["cow_blocks"]  # the forks' partly filled last prompt block
    assert end.counters["prefix_hits"] > started["prefix_hits"]
    assert end.memory["kv_cache"] > 0 and end.memory["weights"] > 0
    assert end.to_dict()["device"]["state_runs"] == end.device.state_runs


def test_a_beam_search_is_a_tree_whose_parents_are_listed(engine):
    """Beams fork (chosen twice) and end every step: each listed beam's parent is a listed beam of the request (its
    nearest live ancestor), and the full blocks of the tokens they share are the same blocks in both tables."""
    engine.add_request("beam", engine.tokenizer.encode(PREFIX),
                       SamplingParams(use_beam_search=True, beam_width=4, max_tokens=10, ignore_eos=True))
    size, forked = engine.block_manager.block_size, 0
    while engine.has_unfinished_requests():
        engine.step()
        snap = build_snapshot(engine)
        requests = [("running", r) for r in engine.scheduler.running]
        check_invariants(engine.block_manager, requests)
        by_id = {s.seq_id: s for s in snap.seqs}
        assert len({s.index for s in snap.seqs}) == len(snap.seqs)  # each beam's label is its own
        for s in snap.seqs:
            if s.parent is not None:
                forked += 1
                k = s.forked_at // size
                assert k >= 3 and s.block_tables[0][:k] == by_id[s.parent].block_tables[0][:k]
    assert forked > 0


def test_top_draws_the_sequences_as_a_tree():
    """The terminal view's sequence rows: each request's root, then its forks with tree glyphs and the tokens they
    share with their parent."""
    from rich.console import Console

    from pagedlm.server.top import TopView

    def seq(rid, index, seq_id, parent=None, at=0):
        return {"request_id": rid, "index": index, "seq_id": seq_id, "status": "running", "num_tokens": 40,
                "num_computed_tokens": 40, "block_tables": [[seq_id]], "opaque": False, "text": None,
                "parent": parent, "forked_at": at}

    seqs = [seq("a", 0, 10), seq("a", 1, 11, 10, 30), seq("a", 3, 13, 11, 35), seq("a", 2, 12, 10, 30),
            seq("b", 0, 20)]
    snap = {"device": {"ref_runs": [1, 32]}, "seqs": seqs, "queues": {"running": 2, "waiting": 0, "swapped": 0}}
    console = Console(record=True, width=100, force_terminal=False)
    console.print(TopView(width=100).seqs_panel(snap))
    rows = [line[2:].split("running")[0].rstrip() for line in console.export_text().splitlines()
            if "running  " in line]  # less the panel's border
    assert rows == ["a #0", "├─ #1 @30", "│  └─ #3 @35", "└─ #2 @30", "b #0"]


def test_nothing_is_built_while_nobody_watches(tiny_model_dir, monkeypatch):
    import pagedlm.engine.async_engine as ae

    calls = []
    real = ae.build_snapshot
    monkeypatch.setattr(ae, "build_snapshot", lambda e, show_text: calls.append(threading.get_ident()) or
                        real(e, show_text))
    engine = AsyncLLMEngine(LLMEngine.from_args(str(tiny_model_dir), dtype="float32", num_kv_blocks=64),
                            LoopConfig.offline(log_interval=0))
    try:
        async def run():
            stream = await engine.add_request("a", "hello there", SamplingParams(max_tokens=8, ignore_eos=True))
            await stream.result()
            assert calls == []
            snap = await engine.snapshot()
            assert calls == [engine._thread.ident]  # on the engine thread
            return snap

        snap = asyncio.run(run())
        assert snap.device.num_used == 0 and snap.counters["generation_tokens"] == 8
    finally:
        engine.shutdown()
    with pytest.raises(Exception, match="shut down"):
        asyncio.run(engine.snapshot())


def test_ui_defaults_to_loopback_binds():
    assert ServerConfig().serves_ui and ServerConfig(host="::1").serves_ui
    assert not ServerConfig(host="0.0.0.0").serves_ui
    assert ServerConfig(host="0.0.0.0", ui=True).serves_ui and not ServerConfig(ui=False).serves_ui


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    """The tiny model behind an API key with the memory views on (prefix caching, 8-token blocks)."""
    engine = AsyncLLMEngine(LLMEngine.from_args(str(tiny_model_dir), dtype="float32", num_kv_blocks=256,
                                                block_size=8, enable_prefix_caching=True, seed=0),
                            LoopConfig.offline(log_interval=0))
    server = InProcessServer(build_app({"tiny": engine}, api_key=KEY, ui=True))
    server.api_key = KEY
    yield server
    server.stop()
    engine.shutdown()


def test_debug_state_needs_the_key_and_ui_assets_do_not(served):
    assert httpx.get(f"{served.url}/debug/state").status_code == 401
    assert httpx.get(f"{served.url}/debug/state", headers={"Authorization": "Bearer wrong"}).status_code == 401
    r = httpx.get(f"{served.url}/debug/state", headers=served.headers())
    assert r.status_code == 200 and r.headers["cache-control"] == "no-store"
    state = r.json()
    snap = state["models"]["tiny"]["replicas"]["0"]
    assert snap["device"]["num_blocks"] == 256 and state["router"] is None and state["show_text"] is False
    page = httpx.get(f"{served.url}/ui")
    assert page.status_code == 200 and "blockmap" in page.text and "frame-ancestors 'none'" in \
        page.headers["content-security-policy"]
    assert all(httpx.get(f"{served.url}/ui/{name}").status_code == 200 for name in ("app.js", "panels.js", "style.css"))
    assert httpx.get(f"{served.url}/ui/..%2Fapi.py").status_code == 404


def test_text_is_hidden_unless_asked(tiny_model_dir):
    engine = AsyncLLMEngine(LLMEngine.from_args(str(tiny_model_dir), dtype="float32", num_kv_blocks=64),
                            LoopConfig.offline(log_interval=0))
    servers = [InProcessServer(build_app({"tiny": engine}, ui=ui, ui_show_text=show))
               for ui, show in ((False, False), (True, False), (True, True))]
    off, hidden, shown = servers
    try:
        assert httpx.get(f"{off.url}/debug/state").status_code == 404  # --no-ui
        assert httpx.get(f"{off.url}/ui").status_code == 404

        def state_during(server):
            stop = threading.Event()

            def load():
                while not stop.is_set():
                    httpx.post(f"{server.url}/v1/completions", json={"prompt": "secret words", "max_tokens": 64,
                                                                     "ignore_eos": True}, timeout=60)
            t = threading.Thread(target=load)
            t.start()
            try:
                for _ in range(500):
                    seqs = httpx.get(f"{server.url}/debug/state").json()["models"]["tiny"]["replicas"]["0"]["seqs"]
                    if seqs:
                        return seqs
                    time.sleep(0.02)
            finally:
                stop.set()
                t.join()
            raise AssertionError("no running sequence seen")

        assert all(s["text"] is None for s in state_during(hidden))
        assert "secret words" in state_during(shown)[0]["text"]
    finally:
        for server in servers:
            server.stop()
        engine.shutdown()


def test_a_salted_tenants_sequences_are_opaque(engine):
    """With text shown, a request whose prefix cache is salted (a tenant's key) still shows no text nor hashes."""
    tok = engine.tokenizer
    engine.add_request("salted", tok.encode(PREFIX), SamplingParams(max_tokens=2, ignore_eos=True),
                       cache_salt="tenant-a")
    engine.add_request("plain", tok.encode(PREFIX + " plain"), SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    snap = build_snapshot(engine, show_text=True)
    by_id = {s.request_id: s for s in snap.seqs}
    assert by_id["salted"].opaque and by_id["salted"].text is None
    assert not by_id["plain"].opaque and "lazy dog" in by_id["plain"].text
    salted_blocks = set(by_id["salted"].block_tables[0])
    assert not salted_blocks & set(snap.device.hashes)
    assert set(by_id["plain"].block_tables[0][:3]) <= set(snap.device.hashes)  # full prompt blocks are hashed
    texts = snap.device.texts  # each block's tokens, the opaque tenant's none
    assert not salted_blocks & set(texts) and "lazy dog" in "".join(texts[b] for b in by_id["plain"].block_tables[0])
    assert build_snapshot(engine).device.texts == {}  # text not shown
    while engine.has_unfinished_requests():
        engine.step()


def test_debug_state_shows_every_model_and_the_routers_decisions(tiny_model_dir):
    from pagedlm.router import HeuristicPolicy, ModelEntry, Router

    router = Router([ModelEntry("small"), ModelEntry("big", strong=True)], HeuristicPolicy(0.5))
    served = []
    with routed_server(tiny_model_dir, router, ui=True) as (server, engines, _):
        for prompt in ("Hello!", "```python\ndef f(n):\n    return n\n```\nProve step by step that f is correct."):
            r = httpx.post(f"{server.url}/v1/completions", json={"model": "auto", "prompt": prompt, "max_tokens": 2},
                           timeout=60)
            assert r.status_code == 200
            served.append(r.headers["x-pagedlm-routed-model"])
        state = httpx.get(f"{server.url}/debug/state").json()
    assert set(state["models"]) == {"small", "big"}
    assert all(m["replicas"]["0"]["device"]["num_blocks"] == 64 for m in state["models"].values())
    rs = state["router"]
    assert rs["policy"] == "HeuristicPolicy" and rs["share"]["requests"] == 2
    assert [d["model"] for d in rs["decisions"]] == served[::-1]  # newest first
    assert len(rs["decisions"]) == 2 and all(d["threshold"] == 0.5 and d["score"] is not None
                                               for d in rs["decisions"])


def _load(server, stop: threading.Event) -> None:
    """Requests with n=4 and a shared prefix, one after another until `stop`."""
    i = 0
    while not stop.is_set():
        httpx.post(f"{server.url}/v1/completions", headers=server.headers(), timeout=60,
                   json={"model": "tiny", "prompt": PREFIX + f" question {i}", "n": 4, "max_tokens": 120,
                         "temperature": 1.0, "ignore_eos": True})
        i += 1


def test_top_under_a_pseudo_terminal(served):
    stop = threading.Event()
    load = threading.Thread(target=_load, args=(served, stop))
    load.start()
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 50, 120, 0, 0))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "TERM": "xterm-256color", "PAGEDLM_API_KEY": KEY}
    env.pop("COLUMNS", None)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "pagedlm.cli", "top", served.url, "--interval", "0.3",
                                 "--iterations", "4"], stdin=slave, stdout=slave, stderr=slave, env=env)
        os.close(slave)
        out = b""
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError:
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        assert proc.wait(30) == 0
    finally:
        stop.set()
        load.join()
        os.close(master)
    text = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", out.decode("utf-8", "replace"))
    assert "pagedlm top · tiny" in text and "KV block pool: 256 blocks of 8 tokens" in text
    assert "Sequences:" in text and "copy-on-write blocks" in text and "TTFT" in text
    shared = [int(n) for n in re.findall(r"shared \((\d+)\)", text)]
    assert len(shared) >= 2 and max(shared) > 0  # refreshed, and the n=4 requests' prefix blocks shown shared
    assert re.search(r"├─ #1 @\d+", text) and re.search(r"└─ #3 @\d+", text)  # the samples forked from #0


def _chromium():
    binary = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver = shutil.which("chromedriver")
    if not (binary and driver):
        pytest.skip("headless Chromium is not installed (Debian: apt-get install chromium chromium-driver)")
    webdriver = pytest.importorskip("selenium.webdriver")
    opts = webdriver.ChromeOptions()
    opts.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1000"):
        opts.add_argument(arg)
    opts.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    from selenium.webdriver.chrome.service import Service

    return webdriver.Chrome(options=opts, service=Service(driver))


def test_web_view_in_headless_chromium(served, tmp_path):
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import WebDriverWait

    browser = _chromium()
    stop = threading.Event()
    load = threading.Thread(target=_load, args=(served, stop))
    try:
        browser.get(f"{served.url}/ui")  # no key: the page asks for one
        WebDriverWait(browser, 20).until(lambda b: b.find_element(By.ID, "keyform").is_displayed())
        assert "API key required" in browser.find_element(By.ID, "status").text
        browser.get_log("browser")  # the 401 is expected there; start the console afresh
        browser.get(f"{served.url}/ui#key={KEY}")
        load.start()
        # read the DOM in one script: the page redraws its rows at every poll
        shown = """return {shared: Number(document.getElementById('shared-count').dataset.shared),
                           cells: [...document.querySelectorAll('#seqs .blk.shared')].map(e => e.dataset.block)}"""
        def shared_shown(b) -> bool:  # a shared block drawn in several sequences' rows
            d = b.execute_script(shown)
            return d["shared"] > 0 and max(Counter(d["cells"]).values(), default=0) >= 2

        WebDriverWait(browser, 60, poll_frequency=0.1).until(shared_shown)
        rows = """return [...document.querySelectorAll('#seqs .seq')].map(
                      r => [r.dataset.seq, r.dataset.parent || null, r.querySelector('.tree').textContent])"""

        def forks_shown(b) -> bool:  # an n=4 request: three rows under the row of their parent
            shown = b.execute_script(rows)
            parents = Counter(p for _, p, _ in shown if p is not None)
            return any(n == 3 and p in {s for s, _, _ in shown} for p, n in parents.items()) and \
                [t for _, p, t in shown if p is not None][-3:] == ["├─ ", "├─ ", "└─ "]

        WebDriverWait(browser, 60, poll_frequency=0.1).until(forks_shown)
        assert "key=" not in browser.current_url  # the key left the address bar
        assert not browser.find_element(By.ID, "keyform").is_displayed()
        assert "blocks of 8 tokens" in browser.find_element(By.ID, "pool-summary").text
        assert "copy-on-write blocks" in browser.find_element(By.ID, "counters").text  # panels.js drew too
        assert len(browser.find_elements(By.CSS_SELECTOR, "#sparks canvas")) == 5
        time.sleep(1.5)  # a few more polls, so that the screenshot's sparklines have a history
        WebDriverWait(browser, 60, poll_frequency=0.05).until(shared_shown)
        path = tmp_path / "memory-view.png"
        browser.save_screenshot(str(path))
        artifacts = os.environ.get("PAGEDLM_TEST_ARTIFACTS")
        if artifacts:
            Path(artifacts).mkdir(parents=True, exist_ok=True)
            shutil.copy(path, Path(artifacts) / path.name)
        assert path.stat().st_size > 10_000
        browser.find_element(By.ID, "play-max").clear()
        browser.find_element(By.ID, "play-max").send_keys("4")
        browser.find_element(By.CSS_SELECTOR, "#play button[type=submit]").click()  # two prompts, n=4, the key
        WebDriverWait(browser, 60).until(lambda b: b.find_element(By.ID, "play-out").text.count("⟶") == 8)
        errors = [e for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        assert errors == []
    finally:
        stop.set()
        if load.is_alive():
            load.join()
        browser.quit()


def test_moe_experts_and_router_in_the_terminal_view(tmp_path):
    """A MoE model's snapshot counts tokens per expert per layer; `pagedlm top`'s panels draw its heatmap and the
    router's line and decisions (rendered through rich's recording console)."""
    from rich.console import Console
    from test_families import build_family

    from pagedlm.router import HeuristicPolicy, ModelEntry, Router
    from pagedlm.router.policies import Decision
    from pagedlm.server.top import TopView
    from pagedlm.server.ui import router_state

    engine = LLMEngine.from_args(str(build_family("qwen2-moe", tmp_path)), dtype="float32", num_kv_blocks=64)
    prompt = list(range(3, 14))
    engine.add_request("m", prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    snap = build_snapshot(engine)
    assert list(snap.moe_expert_tokens) == [1] and len(snap.moe_expert_tokens[1]) == 8  # layer 1 has 8 experts
    # top-2 experts for each token through the (last) layer: every token fed, or in the fused stack, whose last layer
    # runs its MLP for the rows whose logits are read, one per generated token
    from pagedlm.model.llama_decode import load_decode_kernel

    assert sum(snap.moe_expert_tokens[1]) == (3 if load_decode_kernel() is not None else len(prompt) + 2) * 2
    router = Router([ModelEntry("small"), ModelEntry("big", strong=True)], HeuristicPolicy(0.5))
    router.record_served(Decision("big", "score 0.700 >= threshold 0.500", 0.7, category="strong",
                                  policy_strong=True))
    state = {"time": time.time(), "show_text": False, "router": router_state(router),
             "models": {"moe": {"latency": {"ttft_ms": None, "tpot_ms": None}, "replicas": {"0": snap.to_dict()}}}}
    console = Console(record=True, width=110, force_terminal=False)
    console.print(TopView(width=110).render(state))
    text = console.export_text()
    heat = [line for line in text.splitlines() if "layer   1" in line]
    assert len(heat) == 1 and heat[0].count("█") >= 1  # the busiest expert at full shade
    assert "Router: HeuristicPolicy · threshold 0.500 · strong 100 %" in text
    assert "score 0.700 >= threshold 0.500" in text and "0.700/0.500" in text
