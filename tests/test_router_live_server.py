"""The router's promises through the server: spend settled with the tokens used, budget shifts and refusals
(overall and per API key) in the route headers, and the share/threshold/drift/spend gauges in /metrics."""
from __future__ import annotations

import json
import math
import time

import pytest
from server_utils import routed_server

from pagedlm.router import (
    BudgetLimits,
    CascadePolicy,
    HeuristicPolicy,
    ModelEntry,
    Router,
    ShareMonitor,
    SpendLedger,
    WeakAnswer,
)

EASY = "Hello! How are you today?"
HARD = ("```python\ndef solve(n):\n    return n * 2\n```\nExplain step by step why this function computes the "
        "derivative of x^2 + 3 = 5, and prove that it is correct for every integer n.")
PRICES = {"small": (1e-6, 1e-6), "big": (1e-4, 1e-4)}  # dollars per token


@pytest.fixture(scope="module")
def live(tiny_model_dir):
    router = Router([ModelEntry("small", False, *PRICES["small"]), ModelEntry("big", True, *PRICES["big"])],
                    HeuristicPolicy())
    with routed_server(tiny_model_dir, router, api_key=["ka", "kb"]) as (server, engines, _):
        server.engines = engines
        yield server, router


@pytest.fixture()
def env(live, monkeypatch):
    server, router = live
    monkeypatch.setattr(router, "policy", HeuristicPolicy())
    monkeypatch.setattr(router, "served", ShareMonitor())
    return server, router


def ask(server, prompt: str, key: str = "ka", stream: bool = False, max_tokens: int = 3):
    body = {"model": "auto", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    return server.post("/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"})


def usage_of(r) -> dict:
    if r.headers["content-type"].startswith("text/event-stream"):
        events = [json.loads(line[6:]) for line in r.text.splitlines()
                  if line.startswith("data: {") and '"usage"' in line]
        return [e["usage"] for e in events if e.get("usage")][-1]
    return r.json()["usage"]


def settled(ledger: SpendLedger, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while ledger.state().held > 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    return ledger.state()


@pytest.mark.parametrize("stream", [False, True])
def test_spend_is_settled_with_the_tokens_used(env, monkeypatch, stream):
    server, router = env
    ledger = SpendLedger(BudgetLimits(max_cost_per_hour=1.0))
    monkeypatch.setattr(router, "budget", ledger)
    r = ask(server, HARD, stream=stream)
    assert r.status_code == 200 and r.headers["x-pagedlm-route-reason"] == "strong"
    u = usage_of(r)
    st = settled(ledger)
    assert st.held == 0 and u["completion_tokens"] == 3
    assert st.spent == pytest.approx(u["prompt_tokens"] * 1e-4 + u["completion_tokens"] * 1e-4)


def test_near_the_cap_cheaper_then_429(env, monkeypatch):
    server, router = env
    ledger = SpendLedger(BudgetLimits(max_cost_per_hour=1.0, near=0.8))
    monkeypatch.setattr(router, "budget", ledger)
    ledger.settle(ledger.hold(None, 0.0), 0.85)
    r = ask(server, HARD)
    assert r.status_code == 200
    assert (r.headers["x-pagedlm-routed-model"], r.headers["x-pagedlm-route-reason"]) == ("small", "budget")
    assert "budget: server spend" in r.headers["x-pagedlm-route-detail"]
    before = server.metrics().get("pagedlm:router_budget_refusals_total", 0)
    settled(ledger)
    ledger.settle(ledger.hold(None, 0.0), 0.15)
    r = ask(server, EASY)
    assert r.status_code == 429 and r.json()["error"]["code"] == "budget_exceeded"
    assert int(r.headers["retry-after"]) >= 1
    m = server.metrics()
    assert m["pagedlm:router_budget_refusals_total"] == before + 1
    assert m["pagedlm:router_budget_dollars_per_hour"] == 1.0
    assert m["pagedlm:router_spend_window_dollars"] == pytest.approx(ledger.state().spent)


def test_per_key_budget(env, monkeypatch):
    server, router = env
    ledger = SpendLedger(BudgetLimits(max_cost_per_hour_per_key=0.05))
    monkeypatch.setattr(router, "budget", ledger)
    ledger.settle(ledger.hold("ka", 0.0), 0.04999)
    r = ask(server, HARD, key="ka")
    assert r.status_code == 429 and "API key" in r.json()["error"]["message"]
    r = ask(server, HARD, key="kb")
    assert r.status_code == 200 and r.headers["x-pagedlm-route-reason"] == "strong"


def test_share_threshold_drift_and_spend_in_metrics(env, monkeypatch):
    server, router = env
    policy = HeuristicPolicy()
    policy.calibrate_live(0.5, window=8, min_samples=4)
    monkeypatch.setattr(router, "policy", policy)
    monkeypatch.setattr(router, "budget", SpendLedger(BudgetLimits(max_cost_per_hour=100.0)))
    for i in range(10):
        assert ask(server, HARD if i % 2 else EASY, max_tokens=1).status_code == 200
    m = server.metrics(all_labels=True)
    assert m["pagedlm:router_strong_share_target"] == 0.5
    assert 0.0 < m["pagedlm:router_strong_share{kind=realised}"] < 1.0
    assert m["pagedlm:router_threshold"] == pytest.approx(policy.calibrator.threshold)
    assert policy.calibrator.threshold != 0.5  # moved off the offline threshold: EASY/HARD split the window
    assert m["pagedlm:router_score_drift_psi"] >= 0.0
    assert m["pagedlm:router_forced_share{rule=budget,tier=weak}"] == 0.0
    assert m["pagedlm:router_spend_dollars_total"] > 0


def test_serve_flags_build_calibration_and_budget(tmp_path):
    import numpy as np
    from test_router_server import router_config

    from pagedlm.router.classifier import FAST_EMBEDDER, WeakCorrectClassifier
    from pagedlm.server.cli import build_router, describe_router

    names = ["a", "b"]
    assert build_router(router_config(), names).calibrator is None  # heuristic, no share asked: fixed 0.5
    r = build_router(router_config("--strong-fraction", "0.3", "--calibration-window", "200"), names)
    assert (r.calibrator.target, r.calibrator.window, r.served._items.maxlen) == (0.3, 200, 200)
    assert "live calibration to 30% strong" in describe_router(r)
    for fixed in (("--router-threshold", "0.4"), ("--calibration-window", "0")):
        assert build_router(router_config("--strong-fraction", "0.3", *fixed), names).calibrator is None
    r = build_router(router_config("--model-cost", "a=1,2", "--model-cost", "b=10,30", "--max-cost-per-hour", "5",
                                   "--max-cost-per-hour-per-key", "1", "--budget-near", "0.9"), names)
    assert r.budget.limits == BudgetLimits(5.0, 1.0, 0.9)
    for bad in (["--max-cost-per-hour", "5"], ["--model-cost", "a=1,2", "--max-cost-per-hour", "-1"],
                ["--calibration-window", "-1", "--strong-fraction", "0.2"]):
        with pytest.raises(ValueError):
            build_router(router_config(*bad), names)

    r = build_router(router_config("--router", "cascade", "--cascade-threshold", "-0.7", "--strong-fraction",
                                   "0.2"), names)
    assert isinstance(r.policy, CascadePolicy) and r.calibrator.target == 0.2 and r.calibrator.threshold == 0.7

    rng = np.random.default_rng(0)
    clf = WeakCorrectClassifier.fit(rng.normal(size=(200, 384)).astype(np.float32), rng.random(200) < 0.5,
                                    embedder=FAST_EMBEDDER)
    clf.save(tmp_path / "router.pt")
    r = build_router(router_config("--router", "learned", "--router-classifier", str(tmp_path / "router.pt")), names)
    assert r.calibrator.target == 0.5 and r.calibrator.threshold == pytest.approx(clf.threshold_for(0.5))
    assert np.array_equal(r.calibrator.reference, clf.train_scores)


# --- cascade ------------------------------------------------------------------------------------------------------
@pytest.fixture()
def submits(env, monkeypatch):
    """Requests each engine was given."""
    server, _ = env
    counts = {name: 0 for name in server.engines}
    for name, engine in server.engines.items():
        def counting(*args, _submit=engine.submit, _name=name, **kw):
            counts[_name] += 1
            return _submit(*args, **kw)
        monkeypatch.setattr(engine, "submit", counting)
    return counts


def cascade_call(server, prompt: str, chat: bool, stream: bool, **extra):
    body = {"model": "auto", "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": stream, **extra}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    if stream:
        body["stream_options"] = {"include_usage": True}
    r = server.post("/v1/chat/completions" if chat else "/v1/completions", json=body,
                    headers={"Authorization": "Bearer ka"})
    assert r.status_code == 200, r.text
    if not stream:
        out = r.json()
        c = out["choices"][0]
        return r, c["message"]["content"] if chat else c["text"], {out["model"]}, c["logprobs"], out["usage"]
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert r.text.rstrip().endswith("data: [DONE]")
    text = "".join((c["delta"].get("content") or "") if chat else c["text"] for e in events for c in e["choices"])
    logprobs = [c.get("logprobs") for e in events for c in e["choices"] if c.get("logprobs")]
    return r, text, {e["model"] for e in events}, logprobs or None, [e for e in events if e.get("usage")][-1]["usage"]


@pytest.mark.parametrize("chat", [False, True])
def test_cascade_keeps_confident_answers_on_the_weak_model(env, submits, monkeypatch, chat):
    server, router = env
    monkeypatch.setattr(router, "policy", CascadePolicy(min_logprob=-1e9))  # every answer is confident enough
    r, text, models, logprobs, usage = cascade_call(server, HARD, chat, stream=False)
    assert (r.headers["x-pagedlm-routed-model"], r.headers["x-pagedlm-route-reason"]) == ("small", "weak")
    assert "weak answer kept" in r.headers["x-pagedlm-route-detail"]
    assert models == {"small"} and logprobs is None and usage["completion_tokens"] == 4 and text
    r2, streamed, models2, logprobs2, usage2 = cascade_call(server, HARD, chat, stream=True)
    assert r2.headers["x-pagedlm-routed-model"] == "small" and models2 == {"small"}
    assert streamed == text and logprobs2 is None and usage2 == usage  # the same answer, held back then sent
    assert submits == {"small": 2, "big": 0}  # never reached the strong model
    m = server.metrics(all_labels=True)
    assert m["pagedlm:router_cascade_total{outcome=kept}"] >= 2


@pytest.mark.parametrize("chat", [False, True])
def test_cascade_reruns_unconfident_answers_on_the_strong_model(env, submits, monkeypatch, chat):
    server, router = env
    monkeypatch.setattr(router, "policy", CascadePolicy(min_logprob=0.0))  # no answer is confident enough
    direct = server.post("/v1/chat/completions" if chat else "/v1/completions", headers={"Authorization": "Bearer ka"},
                         json={"model": "big", "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                               **({"messages": [{"role": "user", "content": EASY}]} if chat else {"prompt": EASY})})
    c = direct.json()["choices"][0]
    expected = c["message"]["content"] if chat else c["text"]
    submits.update(small=0, big=0)
    for stream in (False, True):
        r, text, models, logprobs, usage = cascade_call(server, EASY, chat, stream)
        assert (r.headers["x-pagedlm-routed-model"], r.headers["x-pagedlm-route-reason"]) == ("big", "strong")
        assert "re-run on the strong model" in r.headers["x-pagedlm-route-detail"]
        assert models == {"big"} and text == expected and usage["completion_tokens"] == 4 and logprobs is None
    assert submits == {"small": 2, "big": 2}  # the weak model answered first each time; its answer never left
    st = router.served.stats()
    assert st.realised == 1.0 and st.policy == 1.0


def test_cascade_logprobs_when_asked_and_live_calibrated_share(env, submits, monkeypatch):
    server, router = env
    policy = CascadePolicy(min_logprob=-1e9)
    policy.calibrate_live(0.5, window=8, min_samples=4)
    monkeypatch.setattr(router, "policy", policy)
    before = server.metrics(all_labels=True)
    _, _, _, logprobs, _ = cascade_call(server, HARD, chat=False, stream=False, logprobs=1)
    assert len(logprobs["token_logprobs"]) == 4  # the client asked: the weak answer's logprobs are kept
    for i in range(11):
        cascade_call(server, f"{EASY} {i} " * (1 + i % 4), chat=False, stream=False)
    assert policy.calibrator.state().samples == 8 and policy.threshold != 1e9  # moved off the start point
    after = server.metrics(all_labels=True)
    outcomes = {o: after[f"pagedlm:router_cascade_total{{outcome={o}}}"]
                - before.get(f"pagedlm:router_cascade_total{{outcome={o}}}", 0) for o in ("kept", "escalated")}
    assert outcomes["escalated"] == submits["big"] and sum(outcomes.values()) == submits["small"] == 12
    assert 3 <= submits["big"] <= 8  # about half once calibrated (none at the start point)


def test_cascade_keeps_the_weak_answer_when_the_strong_rerun_is_over_budget(env, submits, monkeypatch):
    server, router = env
    monkeypatch.setattr(router, "policy", CascadePolicy(min_logprob=0.0))
    ledger = SpendLedger(BudgetLimits(max_cost_per_hour=1.0))
    monkeypatch.setattr(router, "budget", ledger)
    ledger.settle(ledger.hold(None, 0.0), 0.996)  # room for the weak model's answer, not for the strong one's
    r, text, models, _, _ = cascade_call(server, EASY, chat=False, stream=True)
    assert r.headers["x-pagedlm-routed-model"] == "small" and models == {"small"} and text
    assert "strong model is unavailable" in r.headers["x-pagedlm-route-detail"]
    assert submits == {"small": 1, "big": 0}


@pytest.mark.parametrize("chat", [False, True])
def test_cascade_samples_flag_draws_k_at_once_and_their_agreement_decides(env, monkeypatch, chat):
    """`--cascade-samples 3 --cascade-scorer answer`: the weak engine gets one request of n=3 (the prompt's KV
    blocks shared by its samples); the escalation score reads the kept answer's logprobs and the 3 samples'
    agreement, and with the threshold between the answer's score and the score it would have if its samples
    agreed, the same (seeded) answer is re-run on the strong model. The extra samples' tokens are counted from the
    answer: (k-1) x 4 decode tokens, (k-1) x the prompt read from shared blocks, at the weak model's price."""
    from test_router_server import router_config

    from pagedlm.router.answer import agreement
    from pagedlm.server.cli import build_router

    server, router = env
    flags = ("--router", "cascade", "--cascade-scorer", "answer", "--cascade-samples", "3")
    policy = build_router(router_config(*flags), list(server.engines)).policy
    assert isinstance(policy, CascadePolicy) and policy.samples == 3 and policy.scorer.source == "prior"
    policy.threshold = math.inf  # first, keep the answer and read its score
    monkeypatch.setattr(router, "policy", policy)
    params = {name: [] for name in server.engines}
    for name, engine in server.engines.items():
        monkeypatch.setattr(engine, "submit", lambda req, _s=engine.submit, _n=name: params[_n].append(req.params)
                            or _s(req))
    answers = []
    monkeypatch.setattr(policy, "escalate", lambda a, _e=policy.escalate: answers.append(a) or _e(a))
    before = server.metrics(all_labels=True)

    r, text, models, logprobs, usage = cascade_call(server, HARD, chat, stream=False, temperature=1.0, seed=7)
    detail = r.headers["x-pagedlm-route-detail"]
    assert (r.headers["x-pagedlm-routed-model"], r.headers["x-pagedlm-route-reason"]) == ("small", "weak")
    assert [p.n for p in params["small"]] == [3] and params["big"] == []
    (answer,) = answers
    assert len(answer.samples) == 3 and answer.samples[0] == text and len(answer.token_logprobs) == 4
    assert len(r.json()["choices"]) == 1 and usage["completion_tokens"] == 4 and logprobs is None  # the kept one
    assert agreement(answer.samples) < 1 and f"3 samples agree {agreement(answer.samples):.0%}" in detail
    prompt = usage["prompt_tokens"]
    assert (f"2 extra samples: 8 decode tokens, {2 * prompt} prompt tokens read from shared KV blocks (+"
            f"{8 / (prompt + 4):.0%} of the weak answer's cost)") in detail  # small: 1e-6 $ a token in and out

    scored = policy.scorer.score(answer)
    if_agreeing = policy.scorer.score(WeakAnswer(answer.token_logprobs, (answer.samples[0],) * 3))
    assert scored > if_agreeing
    policy.threshold = (scored + if_agreeing) / 2
    r2, text2, models2, _, usage2 = cascade_call(server, HARD, chat, stream=False, temperature=1.0, seed=7)
    assert answers[1] == answer  # the same samples again
    assert (r2.headers["x-pagedlm-routed-model"], r2.headers["x-pagedlm-route-reason"]) == ("big", "strong")
    assert "re-run on the strong model" in r2.headers["x-pagedlm-route-detail"] and models2 == {"big"}
    assert [p.n for p in params["small"]] == [3, 3] and [p.n for p in params["big"]] == [1]

    m = server.metrics(all_labels=True)
    grew = {k: m.get(k, 0) - before.get(k, 0) for k in (
        "pagedlm:router_cascade_sample_tokens_total{kind=extra_decode}",
        "pagedlm:router_cascade_sample_tokens_total{kind=prefill_reused}",
        "pagedlm:router_cascade_sample_cost_dollars_total")}
    assert list(grew.values()) == pytest.approx([16, 4 * prompt, 16e-6])
