"""The cascade's decision path with scripted weak answers: per-token logprob patterns, agreeing and disagreeing
samples, the fitted escalation scorer and live calibration (pure policy code, no engine)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from pagedlm.router import CascadePolicy, EscalationScorer, ModelEntry, Router, WeakAnswer
from pagedlm.router.answer import ANSWER_FEATURES, agreement, answer_features
from pagedlm.router.cascade import SamplesCost, describe_costs

CONFIDENT = [-0.01] * 12
UNSURE = [-1.8, -2.5, -0.9, -3.0, -1.2, -2.2]
AGREE = ("B. closure", "b) Closure", "B closure")
DISAGREE = ("B. closure", "D. size constancy", "A. color constancy")


def feature(answer: WeakAnswer, name: str) -> float:
    return float(answer_features(answer)[ANSWER_FEATURES.index(name)])


def test_answer_features_read_the_logprob_pattern():
    one_bad = WeakAnswer.of([-0.02] * 199 + [-7.0])  # a long sure answer with one guessed token
    assert feature(one_bad, "neg_mean") < 0.1 and feature(one_bad, "neg_min") == pytest.approx(7.0)
    assert feature(one_bad, "unsure_share") == pytest.approx(1 / 200)
    assert feature(WeakAnswer.of(UNSURE), "neg_q25") > 1.5 and feature(WeakAnswer.of(CONFIDENT), "neg_q25") < 0.05
    long, short = WeakAnswer.of([-0.5] * 100), WeakAnswer.of([-0.5] * 4)
    assert feature(long, "neg_mean") == feature(short, "neg_mean")  # the mean cannot tell them apart
    assert feature(long, "neg_sum_per_sqrt_len") == pytest.approx(5.0) and feature(short, "neg_sum_per_sqrt_len") == 1.0
    hostile = answer_features(WeakAnswer.of([-math.inf, math.nan, 3.0]))  # clipped, never inf or nan
    assert np.isfinite(hostile).all() and feature(WeakAnswer.of([-math.inf]), "neg_min") == 30.0
    assert np.isfinite(answer_features(WeakAnswer.of([]))).all()


def test_agreement_among_samples():
    assert agreement(AGREE) == 1.0  # compared on lower-case words: labels written differently agree
    assert agreement(DISAGREE) == pytest.approx(1 / 3)
    assert agreement(["yes", "yes", "no", "yes"]) == 0.75 and agreement(["only one"]) == 1.0
    assert feature(WeakAnswer.of(CONFIDENT, DISAGREE), "disagreement") == pytest.approx(2 / 3)


@pytest.mark.parametrize("samples", [1, 3])
def test_prior_escalates_unsure_and_disagreeing_answers(samples):
    policy = CascadePolicy(min_logprob=-1.0, scorer=EscalationScorer.prior(), samples=samples)
    keep, why = policy.escalate(WeakAnswer.of(CONFIDENT, AGREE[:samples]))
    assert not keep and "weak answer kept" in why
    assert policy.escalate(WeakAnswer.of(UNSURE, AGREE[:samples]))[0]
    hidden = WeakAnswer.of([-0.02] * 60 + [-9.0, -8.0], AGREE[:samples])  # two guessed tokens in a sure answer
    level = WeakAnswer.of([feature(hidden, "neg_mean") * -1] * 62, AGREE[:samples])  # the same mean, no guess
    prior = EscalationScorer.prior()
    assert prior.score(hidden) > prior.score(level) + 0.3
    assert EscalationScorer.mean_logprob().score(hidden) == pytest.approx(EscalationScorer.mean_logprob().score(level))
    if samples > 1:  # sure of every token, but the samples give three different answers
        strong, why = policy.escalate(WeakAnswer.of(CONFIDENT, DISAGREE))
        assert strong and "3 samples agree 33%" in why


def test_mean_scorer_is_the_original_cascade():
    policy = CascadePolicy(min_logprob=-0.7)
    assert policy.threshold == pytest.approx(0.7)
    assert policy.escalate(-0.71)[0] and not policy.escalate(-0.5)[0]
    assert policy.escalate(WeakAnswer.of([-0.1, -1.3]))[0]  # mean -0.7: at the threshold
    assert policy.escalate(-math.inf)[0] and policy.escalate(math.nan)[0]
    assert CascadePolicy(min_logprob=0.0).escalate(-0.0001)[0] and not CascadePolicy(-1e9).escalate(-20.0)[0]
    with pytest.raises(ValueError):
        CascadePolicy(samples=0)


def scripted_answers(n: int, seed: int) -> tuple[list[WeakAnswer], np.ndarray]:
    """Wrong answers differ from right ones in their worst tokens and their samples, not in their mean."""
    rng = np.random.default_rng(seed)
    answers, right = [], rng.random(n) < 0.6
    for ok in right:
        length = int(rng.integers(5, 120))
        lp = -np.abs(rng.normal(0.15, 0.1, size=length))
        if not ok:  # one or two guessed tokens; the rest a little surer, so the mean stays level
            lp[rng.integers(0, length, size=2)] = -rng.uniform(4, 9, size=2)
            lp *= 0.6
        labels = ["B"] * 4 if ok or rng.random() < 0.3 else list(rng.choice(["A", "B", "C", "D"], size=4))
        answers.append(WeakAnswer.of(lp.tolist(), labels))
    return answers, right


def auc(scores: np.ndarray, right: np.ndarray) -> float:
    """Probability that a wrong answer scores above a right one (ties count half)."""
    wrong, ok = scores[~right], scores[right]
    return float(((wrong[:, None] > ok[None, :]).mean() + 0.5 * (wrong[:, None] == ok[None, :]).mean()))


def test_fitted_scorer_catches_wrong_answers_the_mean_misses(tmp_path):
    train, right = scripted_answers(1500, seed=0)
    test, right_test = scripted_answers(1500, seed=1)
    fitted = EscalationScorer.fit(np.array([answer_features(a) for a in train]), right)
    by = {name: np.array([s.score(a) for a in test]) for name, s in
          (("mean", EscalationScorer.mean_logprob()), ("prior", EscalationScorer.prior()), ("fit", fitted))}
    area = {k: auc(v, right_test) for k, v in by.items()}
    assert area["fit"] > 0.98 and area["prior"] > area["mean"] + 0.1, area
    fitted.save(tmp_path / "cascade.json")
    back = EscalationScorer.load(tmp_path / "cascade.json")
    assert back.score(test[0]) == pytest.approx(fitted.score(test[0]))
    (tmp_path / "bad.json").write_text('{"format": "pagedlm-cascade-v1", "features": ["neg_mean"]}')
    with pytest.raises(ValueError, match="not a pagedlm cascade scorer"):
        EscalationScorer.load(tmp_path / "bad.json")
    with pytest.raises(ValueError):
        EscalationScorer(np.ones(3), np.zeros(3), np.ones(3))
    with pytest.raises(ValueError, match="both right and wrong"):
        EscalationScorer.fit(np.array([answer_features(a) for a in train]), np.ones(len(train), dtype=bool))


def test_live_calibration_holds_the_escalation_share_and_picks_the_worst():
    answers, right = scripted_answers(3000, seed=2)
    policy = CascadePolicy(min_logprob=-1.0, scorer=EscalationScorer.prior(), samples=4)
    policy.calibrate_live(0.3, window=500, min_samples=50)
    strong = np.array([policy.escalate(a)[0] for a in answers])
    assert abs(strong[500:].mean() - 0.3) < 0.05
    assert (~right[strong]).mean() > 2 * (~right[~strong]).mean()  # escalated answers are mostly the wrong ones


def test_router_escalates_a_scripted_answer_to_the_strong_model():
    policy = CascadePolicy(scorer=EscalationScorer.prior(), samples=3)
    router = Router([ModelEntry("small"), ModelEntry("big", strong=True)], policy)
    first = router.route("Which option is right?\nA. x\nB. y\nC. z\nD. w\nAnswer:", 8)
    assert first.model == "small"
    d, why = router.escalate(first, WeakAnswer.of(CONFIDENT, DISAGREE), "Which option?", 8)
    assert d is not None and d.model == "big" and d.policy_strong and "re-run" in why
    d, why = router.escalate(first, WeakAnswer.of(CONFIDENT, AGREE), "Which option?", 8)
    assert d is None and "kept" in why



def test_extra_cost_of_the_samples_from_their_tokens():
    """k samples cost k-1 decodes beyond the kept answer, no prefill (the prompt's KV blocks are shared), at the
    weak model's output price; one sample costs nothing extra."""
    router = Router([ModelEntry("small", False, 1e-6, 2e-6), ModelEntry("big", True, 1e-4, 1e-4)],
                    CascadePolicy(samples=3))
    first = router.route("2 + 2 =", 8)
    cost = router.samples_cost(first, 40, [5, 8, 3])
    assert (cost.samples, cost.extra_decode_tokens, cost.prefill_reused_tokens) == (3, 11, 80)
    assert cost.extra_cost == pytest.approx(11 * 2e-6) and cost.answer_cost == pytest.approx(40e-6 + 10e-6)
    assert cost.describe() == ("2 extra samples: 11 decode tokens, 80 prompt tokens read from shared KV blocks "
                               "(+44% of the weak answer's cost)")
    one = router.samples_cost(first, 40, [5])
    assert (one.extra_decode_tokens, one.prefill_reused_tokens, one.extra_cost) == (0, 0, 0.0)
    assert "3.00 decode tokens (0.75x the kept answer's 4.00)" in describe_costs([SamplesCost(10, (4, 1, 2))] * 2)

def test_train_cascade_cli_fits_a_scorer_the_server_can_load(tmp_path, capsys):
    import json

    from pagedlm.cli import main

    answers, right = scripted_answers(600, seed=3)
    data = tmp_path / "answers.jsonl"
    data.write_text("".join(json.dumps({"token_logprobs": list(a.token_logprobs), "samples": list(a.samples),
                                        "weak_correct": bool(ok), "prompt_tokens": 30,
                                        "sample_tokens": [len(a.token_logprobs)] + [2] * (len(a.samples) - 1)}) + "\n"
                            for a, ok in zip(answers, right)))
    assert main(["router", "train-cascade", str(data), "--out", str(tmp_path / "c.json")]) == 0
    out = capsys.readouterr().out
    fitted = float(out.split("fitted ")[1].split(",")[0])
    mean = float(out.split("mean logprob ")[1].split(";")[0])
    assert fitted > 0.95 > mean
    k = max(len(a.samples) for a in answers)
    extra = np.mean([2 * (len(a.samples) - 1) for a in answers])
    assert f"extra weak-model cost of {k} samples, per request (600 requests): {extra:.2f} decode tokens" in out
    scorer = EscalationScorer.load(tmp_path / "c.json")
    assert scorer.score(answers[0]) != scorer.score(answers[1])
    (tmp_path / "bad.jsonl").write_text('{"token_logprobs": [-0.1]}\n')
    with pytest.raises(SystemExit, match="bad.jsonl:1"):
        main(["router", "train-cascade", str(tmp_path / "bad.jsonl"), "--out", str(tmp_path / "x.json")])
