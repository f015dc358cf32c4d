"""Data parallelism: engine replicas as Ray actors behind the server and `LLM`, replica routing, lost replicas.

The Ray part shares one local Ray (2 CPUs, started by `LLM(data_parallel_size=2)` as `pagedlm serve` starts it)
and its pair of replicas across the module; the last test kills Ray's raylet and waits for both to come back. The
policy and hashing tests need no Ray.
"""
from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from pagedlm.dp.placement import LeastLoadedPolicy, LoadStats, PrefixAffinityPolicy, ReplicaLoad, RoundRobinPolicy
from pagedlm.dp.replica_set import ReplicaRequest
from pagedlm.kvcache.block_manager import BlockManager
from pagedlm.sampling.params import SamplingParams

BLOCK = 16


def _features(prompt_tokens: int) -> ReplicaRequest:
    return ReplicaRequest(None, prompt_tokens, [])


def _cand(name: str, **kw) -> ReplicaLoad:
    return ReplicaLoad(name, LoadStats(replica=name, block_size=BLOCK, **kw))


# ---- policies (no Ray) ----

def test_replica_policies_never_pick_a_replica_that_cannot_fit_while_another_can():
    f = _features(20 * BLOCK)  # needs 21 blocks
    full = _cand("a", free_blocks=5, prefix_blocks=10)  # short by 6 even with its cached prefix
    roomy = _cand("b", free_blocks=100, running=6)
    for policy in (PrefixAffinityPolicy(), LeastLoadedPolicy(), RoundRobinPolicy()):
        assert {policy.choose(f, [full, roomy]).replica for _ in range(3)} == {"b"}, type(policy).__name__
    # nobody fits: still placed (it waits), on the least loaded
    assert LeastLoadedPolicy().choose(f, [full, _cand("c", free_blocks=1, running=3)]).replica == "a"
    # the cached prefix counts: 21 - 18 cached = 3 blocks needed, 5 free
    assert PrefixAffinityPolicy().choose(f, [_cand("a", free_blocks=5, prefix_blocks=18), roomy]).replica == "a"


def test_prefix_affinity_prefers_the_longest_cached_prefix_within_the_load_slack():
    f = _features(40 * BLOCK)
    cands = [_cand("a", free_blocks=99, prefix_blocks=2, running=1),
             _cand("b", free_blocks=99, prefix_blocks=30, running=5), _cand("c", free_blocks=99)]
    d = PrefixAffinityPolicy(max_imbalance=8).choose(f, cands)
    assert d.replica == "b" and "30 blocks cached" in d.reason
    d = PrefixAffinityPolicy(max_imbalance=4).choose(f, cands)  # b is 5 busier than c: load wins
    assert d.replica == "c" and "busier" in d.reason
    assert PrefixAffinityPolicy().choose(f, [_cand("a", running=2), _cand("b", running=1)]).replica == "b"
    assert PrefixAffinityPolicy().choose(f, [_cand("a", prefix_blocks=9, healthy=False), cands[2]]).replica == "c"


def test_round_robin_cycles_over_healthy_replicas():
    rr = RoundRobinPolicy()
    cands = [_cand("0"), _cand("1", healthy=False), _cand("2")]
    assert [rr.choose(None, cands).replica for _ in range(4)] == ["0", "2", "0", "2"]


def test_every_replica_policy_flag_has_a_policy():
    from pagedlm.config import parallel
    from pagedlm.dp.placement import REPLICA_POLICIES

    assert set(parallel.REPLICA_POLICIES) == set(REPLICA_POLICIES)


def test_published_hashes_are_the_engines_chain_hashes():
    """The router's prompt hashes match the KV events of the block pool that cached the prompt."""
    from pagedlm.dp.prefix_index import prompt_block_hashes, short_hash

    class Seq:
        def __init__(self, ids, salt=None):
            self.seq_id, self.ids, self.cache_salt = 1, ids, salt
            self.num_computed_tokens = 0

        @property
        def num_tokens(self):
            return len(self.ids)

        def token_slice(self, a, b):
            return self.ids[a:b]

    ids = list(range(100, 100 + 5 * BLOCK + 3))
    for salt in (None, "tenant"):
        bm = BlockManager(32, BLOCK, enable_prefix_caching=True)
        bm.gpu.events = []
        seq = Seq(ids, salt)
        bm.allocate(seq, len(ids))
        bm.commit(seq, len(ids))
        stored = [short_hash(h) for ok, h in bm.gpu.drain_events() if ok]
        assert stored == prompt_block_hashes(ids + [0], BLOCK, salt) == prompt_block_hashes(ids, BLOCK, salt)[:5]
        assert len(stored) == 5
    assert prompt_block_hashes(ids, BLOCK, "tenant") != prompt_block_hashes(ids, BLOCK)


def test_bad_replica_flags_fail_before_anything_starts(capsys):
    from pagedlm import LLM
    from pagedlm.cli import main

    assert main(["serve", "--data-parallel-size", "0", "--port", "0"]) == 2
    assert "--data-parallel-size" in capsys.readouterr().err
    with pytest.raises(ValueError, match="block_size"):
        LLM(model="no-such-model", data_parallel_size=2, block_size=3)


# ---- the Ray watch (no Ray: a fake cluster handle) ----

class _FakeClient:
    """What a replica set and the watch use of a ReplicaClient."""

    input_processor, max_waiting, stall_timeout, tokenizer, on_lost = None, 8, 0.0, "tokenizer", None

    def __init__(self, name: str) -> None:
        self.name, self.restarts, self.shut_remote = name, 0, None

    @property
    def is_running(self) -> bool:
        return self.shut_remote is None

    def add_listener(self, fn) -> None:
        pass

    def shutdown(self, timeout: float = 10.0, remote: bool = True) -> None:
        self.shut_remote = remote

    def carry_over(self, prev: _FakeClient) -> None:
        self.restarts = prev.restarts + 1


class _FakeCluster:
    """A joined cluster that goes away (`gone`) and comes back: down while gone, and joined again only after."""

    started, num_cpus, cpus, probe = False, 2.0, [0, 1], "head:6379"

    def __init__(self) -> None:
        self.gone, self.events = False, []

    def down_reason(self) -> str | None:
        return "the Ray cluster at head:6379 does not answer" if self.gone else None

    def disconnect(self) -> None:
        self.events.append("disconnect")

    def reconnect(self, **init_kwargs) -> None:
        self.events.append("reconnect")
        if self.gone:
            raise ConnectionError("the Ray cluster at head:6379 is not back")

    def stop(self) -> None:
        pass


def _until(condition, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_the_ray_watch_brings_a_joined_cluster_back_with_every_set(monkeypatch):
    """A joined cluster (--ray-address) that stops answering: each replica set on it says why (/health's 503),
    its replicas are taken out (their requests fail), the watch leaves Ray and tries to join again, periodically,
    until the cluster is back; then every set gets fresh replicas (restart counters carried over) and is healthy,
    and the watch goes on watching (a second outage too). The state machine with a fake cluster handle: a real
    cluster stopped and started again takes longer than a unit test should (test_the_joined_gcs_probe... covers
    the probe)."""
    from pagedlm.dp.cluster import RayCluster
    from pagedlm.dp.launch import RayWatch
    from pagedlm.dp.replica_set import ReplicaSet

    monkeypatch.setattr(RayWatch, "WATCH_S", 0.005)
    monkeypatch.setattr(RayWatch, "RETRY_S", 0.005)
    monkeypatch.setattr(RayWatch, "MAX_RETRY_S", 0.01)
    monkeypatch.setattr(RayWatch, "current", None)
    cluster, started = _FakeCluster(), []

    def start(c, tokenizer=None) -> list[_FakeClient]:
        assert tokenizer in (None, "tokenizer")
        started.append(c)
        return [_FakeClient("0"), _FakeClient("1")]

    watch = RayWatch.of(cluster, {})
    sets = []
    for c in (cluster, RayCluster(False, 2.0, [0, 1])):  # a second model's set joins the same Ray: one watch
        assert RayWatch.of(c, {}) is watch
        sets.append(ReplicaSet(start(c)))
        watch.add(sets[-1], c, start)
    try:
        for outage in (1, 2):
            assert all(rs.down_reason is None for rs in sets)
            old = [list(rs.replicas.values()) for rs in sets]
            cluster.gone, cluster.events = True, []
            _until(lambda: all(rs.down_reason for rs in sets), "the sets say that Ray is down")
            for rs in sets:
                assert "does not answer" in rs.down_reason and "joining it again" in rs.down_reason
            assert all(c.shut_remote is False for clients in old for c in clients)  # out, their actors gone
            _until(lambda: cluster.events.count("reconnect") >= 3, "tries to join again, periodically")
            assert cluster.events[0] == "disconnect" and all(rs.down_reason for rs in sets)
            cluster.gone = False
            _until(lambda: all(rs.down_reason is None for rs in sets), "the sets are back")
            for rs, clients in zip(sets, old):
                assert sorted(rs.replicas) == ["0", "1"] and all(rs.replicas[c.name] is not c for c in clients)
                assert {c.restarts for c in rs.replicas.values()} == {outage}
            assert started[-2:] == [cluster, sets[1].watch.cluster]
    finally:
        for rs in sets:
            rs.shutdown(timeout=5.0)
    assert watch.closed.is_set() and not watch.sets


def test_the_joined_gcs_probe_says_when_a_cluster_is_gone_and_is_not_joined_before_it_answers(monkeypatch):
    """A joined cluster is down while its GCS (host:port) takes no connection; reconnecting before it answers is a
    ConnectionError at once, without ray.init (which would wait on a cluster that is gone)."""
    import socket

    from pagedlm.dp import cluster as cluster_module

    with socket.socket() as gcs:
        gcs.bind(("127.0.0.1", 0))
        gcs.listen()
        joined = cluster_module.RayCluster(False, 2.0, [0], "auto", f"127.0.0.1:{gcs.getsockname()[1]}")
        assert joined.down_reason() is None
    assert "the Ray cluster at auto (127.0.0.1:" in joined.down_reason()
    monkeypatch.setattr(cluster_module, "connect_ray", lambda *a, **kw: pytest.fail("joined a cluster that is gone"))
    with pytest.raises(ConnectionError, match="is not back"):
        joined.reconnect()


# ---- replicas on Ray ----

def test_a_local_ray_starts_only_with_token_authentication(monkeypatch):
    """Ray's services listen on every interface: a local cluster without its token would run anyone's code."""
    from pagedlm.dp.cluster import _require_token_auth

    monkeypatch.delenv("RAY_AUTH_MODE", raising=False)
    _require_token_auth("2.60.0")  # unset: Ray's own default, token authentication, from 2.59
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    _require_token_auth("2.60.0")
    with pytest.raises(RuntimeError, match="ray>=2.59"):
        _require_token_auth("2.58.1")
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")
    with pytest.raises(RuntimeError, match="RAY_AUTH_MODE=disabled"):
        _require_token_auth("2.60.0")


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    """(one local engine, two replicas via LLM(data_parallel_size=2), which starts Ray); Ray stops at the end."""
    ray = pytest.importorskip("ray", reason="ray is not installed (pip install pagedlm[ray])")
    from pagedlm import LLM

    kw = dict(model=str(tiny_model_dir), dtype="float32", num_kv_blocks=128, max_num_seqs=16)
    ref = LLM(**kw)
    for attempt in range(2):  # Ray gives its node 30 s to start: a busy shared machine can miss that once
        try:
            dp = LLM(**kw, data_parallel_size=2)
            break
        except Exception:
            ray.shutdown()
            if attempt:
                raise
    try:
        yield ref, dp
    finally:
        dp.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def server(models):
    from server_utils import InProcessServer

    from pagedlm.server.api import build_app

    srv = InProcessServer(build_app({"tiny": models[1].replicas}))
    yield srv
    srv.stop()


_GCS_PROBE = """
import sys
from ray._raylet import GcsClient
try:
    GcsClient(address=sys.argv[1]).internal_kv_get(b"pagedlm-probe", namespace=None, timeout=5)
except Exception as e:
    print("refused:", type(e).__name__, str(e)[:200])
else:
    print("answered")
"""


def test_the_local_cluster_refuses_clients_without_its_token(models, tmp_path):
    """The Ray that pagedlm started listens on the machine's routable address (Ray makes a loopback node address
    the routable one) with token authentication: a client without the token, or with a wrong one, is refused by
    its GCS; with the token it is answered (so the refusals are the token's doing)."""
    import ray
    from ray._raylet import AuthenticationTokenLoader

    assert models[1].replicas.watch is not None  # the replicas' own cluster, not one joined
    gcs = ray._private.worker._global_node.gcs_address
    token = AuthenticationTokenLoader.instance().get_raw_token()
    assert token and os.environ["RAY_AUTH_MODE"] == "token"
    base = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")} | {"HOME": str(tmp_path)}

    def probe(**env: str) -> str:
        r = subprocess.run([sys.executable, "-c", _GCS_PROBE, gcs], env={**base, **env}, capture_output=True,
                           text=True, timeout=60)
        return r.stdout.strip() or r.stderr[-300:]

    assert probe(RAY_AUTH_MODE="disabled").startswith("refused"), "a client without a token got in"
    assert probe(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="x" * len(token)).startswith("refused")
    assert probe(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token) == "answered"


PROMPTS = ["The quick brown fox", "Once upon a time, there was", "It was the best of times", "Hello! How are you",
           "The engine schedules requests", "Numbers like 1, 2, 3", "Paris is the capital", "A paged key value"]


def _ids(outs):
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow
def test_offline_data_parallel_matches_one_engine_in_input_order(models):
    ref, dp = models
    params = [SamplingParams(temperature=0, max_tokens=8 + 3 * i) for i in range(len(PROMPTS))]
    before = dict(dp.replicas.decisions)
    want, got = ref.generate(PROMPTS, params, use_tqdm=False), dp.generate(PROMPTS, params, use_tqdm=False)
    assert _ids(got) == _ids(want)
    assert [len(o.outputs[0].token_ids) for o in got] == [8 + 3 * i for i in range(len(PROMPTS))]
    assert [o.prompt for o in got] == PROMPTS
    spread = {k: v - before[k] for k, v in dp.replicas.decisions.items()}
    assert sum(spread.values()) == len(PROMPTS) and min(spread.values()) >= 2, spread
    assert [c.info.num_threads for c in dp.replicas.replicas.values()] == [1, 1]


@pytest.mark.slow
def test_two_replicas_serve_the_same_greedy_answers_as_one_engine(models, server):
    ref, dp = models
    tok = ref.get_tokenizer()
    want = ref.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True), use_tqdm=False)

    def ask(prompt: str) -> list[int]:
        r = server.post("/v1/completions", json={"prompt": prompt, "max_tokens": 10, "temperature": 0,
                                                 "ignore_eos": True})
        assert r.status_code == 200, r.text
        return tok.encode(r.json()["choices"][0]["text"], add_special_tokens=False)

    answers: dict[int, list[int]] = {}
    threads = [threading.Thread(target=lambda i=i: answers.__setitem__(i, ask(PROMPTS[i]))) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert [answers[i] for i in range(8)] == [tok.encode(o.outputs[0].text, add_special_tokens=False) for o in want]
    # streaming crosses the actor boundary as a stream of deltas (long enough that the replica's long poll returns
    # before the request ends: at a millisecond a step, 10 tokens may all arrive in one delta)
    long = ref.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=300, ignore_eos=True), use_tqdm=False)
    with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                      json={"prompt": PROMPTS[0], "max_tokens": 300, "temperature": 0, "ignore_eos": True,
                            "stream": True}) as r:
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and len(events) >= 3
    assert "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1]) == long[0].outputs[0].text
    # bad input from a replica is still the client's 400
    r = server.post("/v1/completions", json={"prompt": [10**6], "max_tokens": 4})
    assert r.status_code == 400 and "token ids" in r.json()["error"]["message"]
    # token controls and grammars are checked by the front end before a replica sees them
    r = server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "logit_bias": {"99999999": 5}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logit_bias"
    r = server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 4, "structured_outputs": {"regex": "("}})
    assert r.status_code == 400
    r = server.post("/v1/completions", json={"prompt": "hi", "max_tokens": 6, "temperature": 0,
                                             "structured_outputs": {"choice": ["yes", "no"]}})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] in ("yes", "no")
    m = server.metrics(all_labels=True)
    assert {k for k in m if k.startswith("vllm:num_requests_running{")} == {
        "vllm:num_requests_running{model_name=tiny,replica=0}", "vllm:num_requests_running{model_name=tiny,replica=1}"}
    assert m["pagedlm:replica_healthy{model_name=tiny,replica=0}"] == 1.0
    deadline = time.monotonic() + 10  # step records come with the replica's next poll
    while sum(v for k, v in m.items() if k.startswith("vllm:request_success_total{")) < 9:
        assert time.monotonic() < deadline, m
        time.sleep(0.1)
        m = server.metrics(all_labels=True)


@pytest.mark.slow
def test_the_memory_view_shows_each_replica(models):
    """/debug/state (docs/memory-view.md) holds one snapshot per replica, each built in its actor."""
    from server_utils import InProcessServer

    from pagedlm.server.api import build_app

    srv = InProcessServer(build_app({"tiny": models[1].replicas}, ui=True))
    try:
        assert srv.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 4}).status_code == 200
        state = httpx.get(f"{srv.url}/debug/state", timeout=60).json()
    finally:
        srv.stop()
    replicas = state["models"]["tiny"]["replicas"]
    assert sorted(replicas) == sorted(models[1].replicas.replicas) and len(replicas) == 2
    assert all(r["device"]["num_blocks"] == 128 and r["device"]["num_used"] == 0 for r in replicas.values())
    assert sum(r["counters"]["generation_tokens"] for r in replicas.values()) >= 4


def test_requests_sharing_a_long_system_prompt_land_on_the_replica_that_cached_it(models, server):
    rs = models[1].replicas
    system = ("You are a careful assistant. " + _CORPUS) * 4

    def send(i: int) -> None:
        r = server.post("/v1/completions", json={"prompt": f"{system} Question {i}:", "max_tokens": 4})
        assert r.status_code == 200, r.text

    before = dict(rs.decisions)
    send(0)
    first = next(k for k, v in rs.decisions.items() if v > before[k])
    holder = rs.replicas[first]
    hashes = _hashes(rs, f"{system} Question 9:")

    def published() -> int:  # leading blocks of the prompt in the replica's published cache (its KV events)
        return len(list(itertools.takewhile(holder.prefix.cached.__contains__, hashes)))

    deadline = time.monotonic() + 10
    while published() < len(hashes) - 2 and time.monotonic() < deadline:
        time.sleep(0.05)  # published with the replica's next poll
    assert published() >= len(hashes) - 2 >= 8
    assert not any(h in other.prefix.cached for other in rs.replicas.values() if other is not holder for h in hashes)
    hits0 = holder.stats.prefix_cache_hits
    threads = [threading.Thread(target=send, args=(i,)) for i in range(1, 5)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = {k: v - before[k] for k, v in rs.decisions.items()}
    assert after[first] == 5 and sum(after.values()) == 5, after
    time.sleep(0.6)
    assert holder.stats.prefix_cache_hits - hits0 >= 4 * 8 * BLOCK


_CORPUS = ("A paged key value cache stores attention keys and values in fixed size blocks, so that memory for many "
           "sequences can be shared and reused without fragmentation. ")


def _hashes(rs, text: str) -> list[int]:
    from pagedlm.dp.prefix_index import prompt_block_hashes

    return prompt_block_hashes(rs.tokenizer.encode(text), rs.input_processor.info.kv.block_size)


@pytest.mark.slow
def test_a_killed_replica_loses_no_unstarted_request_and_comes_back(models, server):
    ref, dp = models
    rs = dp.replicas
    rs.policy = RoundRobinPolicy()
    try:
        long = dict(max_tokens=400, temperature=0, ignore_eos=True)
        want = ref.generate(PROMPTS[:4], SamplingParams(**long), use_tqdm=False)
        stream_events: list[str] = []
        first_chunk = threading.Event()

        def stream() -> None:
            with httpx.stream("POST", f"{server.url}/v1/completions", timeout=60,
                              json={"prompt": PROMPTS[5], "stream": True, **long}) as r:
                for line in r.iter_lines():
                    if line.startswith("data: "):
                        stream_events.append(line[6:])
                        first_chunk.set()

        st = threading.Thread(target=stream)
        st.start()
        assert first_chunk.wait(30)
        victim = next(c for c in rs.replicas.values() if c.num_open_requests)
        results: dict[int, httpx.Response] = {}
        posts = [threading.Thread(target=lambda i=i: results.__setitem__(
            i, server.post("/v1/completions", json={"prompt": PROMPTS[i], **long}))) for i in range(4)]
        for t in posts:
            t.start()
        deadline = time.monotonic() + 20
        while victim.stats.num_running < 3 and time.monotonic() < deadline:
            time.sleep(0.002)
        assert victim.stats.num_running >= 3  # the stream and two of the four run there
        os.kill(victim.pid, signal.SIGKILL)
        for t in [*posts, st]:
            t.join(60)
        tok = ref.get_tokenizer()
        for i in range(4):
            assert results[i].status_code == 200, results[i].text
            assert results[i].json()["choices"][0]["text"] == want[i].outputs[0].text
        assert stream_events[-1] == "[DONE]"
        assert "error" in json.loads(stream_events[-2]) and "lost" in json.loads(stream_events[-2])["error"]["message"]
        assert 0 < len(tok.encode("".join(json.loads(e)["choices"][0]["text"] for e in stream_events[:-2]),
                                  add_special_tokens=False)) < 400
        assert rs.retries[victim.name] >= 2
        deadline = time.monotonic() + 120
        while not (victim.healthy and victim.restarts == 1) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert victim.healthy and victim.restarts == 1
        m = server.metrics(all_labels=True)
        assert m[f"pagedlm:replica_restarts_total{{model_name=tiny,replica={victim.name}}}"] == 1
        assert m[f"pagedlm:replica_retries_total{{model_name=tiny,replica={victim.name}}}"] >= 2
        r = server.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0})
        assert r.status_code == 200
        assert len(dp.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)) == 8
        assert min(rs.decisions.values()) > 0
    finally:
        rs.policy = PrefixAffinityPolicy()


@pytest.mark.slow
def test_a_dead_raylet_is_reported_and_ray_comes_back_with_the_replicas(models, server):
    """Ray's raylet dies (as it does after its dashboard agent): every replica goes with it and Ray cannot restart
    them. The set that started this Ray says why on /health (503), restarts Ray and its replicas, and serves again;
    the restarts show in the metrics. Runs last: it replaces the module's Ray."""
    import ray

    ref, dp = models
    rs = dp.replicas
    raylet = ray._private.worker._global_node.all_processes["raylet"][0].process
    before = {name: c.restarts for name, c in rs.replicas.items()}
    os.kill(raylet.pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while (r := httpx.get(f"{server.url}/health", timeout=10)).status_code == 200 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert r.status_code == 503 and "raylet exited" in r.json()["error"]["message"], r.text
    deadline = time.monotonic() + 120
    while rs.down_reason is not None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert rs.down_reason is None and httpx.get(f"{server.url}/health", timeout=10).status_code == 200
    assert {name: c.restarts for name, c in rs.replicas.items()} == {k: v + 1 for k, v in before.items()}
    want = ref.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    got = dp.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
    assert _ids(got) == _ids(want)
    r = server.post("/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 6, "temperature": 0})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == want[0].outputs[0].text
    m = server.metrics(all_labels=True)
    assert m["pagedlm:replica_restarts_total{model_name=tiny,replica=0}"] == before["0"] + 1
