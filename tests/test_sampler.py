import math

import pytest
import torch

import pagedlm.sampling.sampler as sampler_mod
from pagedlm import cbuild
from pagedlm.sampling.params import SamplingParams
from pagedlm.sampling.sampler import Sampler, SamplingRow, prompt_logprobs

EOS = 7


def row(prompt=(), output=(), seed=None, **kw):
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    return SamplingRow(SamplingParams(**kw), list(prompt), list(output), gen)


def counts(tokens, vocab):
    return torch.bincount(torch.tensor(tokens), minlength=vocab).float() / len(tokens)


def test_greedy_equals_argmax_any_dtype():
    torch.manual_seed(0)
    logits = torch.randn(6, 100)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        x = logits.to(dtype)
        out = Sampler()(x, [row(temperature=0.0) for _ in range(6)])
        assert out.token_ids == x.float().argmax(-1).tolist()
        assert out.top_logprobs == [None] * 6
        ref = torch.log_softmax(x.float(), -1)
        assert out.logprobs == pytest.approx([ref[i, t].item() for i, t in enumerate(out.token_ids)], abs=1e-5)


def test_input_logits_not_modified():
    torch.manual_seed(0)
    logits = torch.randn(3, 20)
    before = logits.clone()
    rows = [row(output=[1, 2], temperature=0.7, top_k=3, top_p=0.5, min_p=0.1, repetition_penalty=1.3,
                presence_penalty=0.5, frequency_penalty=0.5, min_tokens=5) for _ in range(3)]
    Sampler({EOS})(logits, rows)
    assert torch.equal(logits, before)


def test_empty_batch():
    out = Sampler()(torch.zeros(0, 10), [])
    assert out.token_ids == [] and out.logprobs == [] and out.top_logprobs == []


def test_repetition_penalty_values():
    x = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0]])
    r = row(prompt=[0], output=[1, 1], repetition_penalty=2.0)
    got = Sampler._apply_penalties(x.clone(), [r])
    assert torch.allclose(got, torch.tensor([[1.0, -2.0, 0.5, 3.0, -2.0]]))


def test_presence_frequency_penalty_values():
    x = torch.zeros(1, 5)
    r = row(prompt=[3], output=[1, 1, 2], presence_penalty=0.5, frequency_penalty=0.25)
    got = Sampler._apply_penalties(x, [r])
    assert torch.allclose(got, torch.tensor([[0.0, -1.0, -0.75, 0.0, 0.0]]))  # prompt tokens don't count


def test_all_penalties_combined_and_neutral_rows_untouched():
    x = torch.tensor([[2.0, -1.0, 0.5, 3.0], [2.0, -1.0, 0.5, 3.0]])
    rows = [
        row(prompt=[3], output=[0, 1, 1], repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=-0.5),
        row(prompt=[3], output=[0, 1, 1]),
    ]
    got = Sampler._apply_penalties(x.clone(), rows)
    # row 0: rep -> [1, -2, .5, 1.5]; then -= 0.5*(count>0) - 0.5*count
    assert torch.allclose(got[0], torch.tensor([1.0 - 0.5 + 0.5, -2.0 - 0.5 + 1.0, 0.5, 1.5]))
    assert torch.equal(got[1], x[1])


def test_penalties_change_greedy_choice():
    logits = torch.tensor([[2.0, 1.5, 0.0, -5.0]] * 3)
    rows = [
        row(prompt=[0], temperature=0.0, repetition_penalty=2.0),  # 2 -> 1 < 1.5
        row(output=[0], temperature=0.0, presence_penalty=1.0),  # 2 -> 1
        row(output=[0], temperature=0.0, frequency_penalty=0.3),  # 2 -> 1.7 still wins
    ]
    assert Sampler()(logits, rows).token_ids == [1, 1, 0]


def test_min_tokens_blocks_eos_and_stop_token_ids():
    logits = torch.zeros(6, 10)
    logits[:, EOS] = 10.0
    logits[:, 3] = 9.0
    logits[:, 5] = 8.0
    rows = [
        row(output=[1, 1], min_tokens=3, temperature=0.0),  # eos masked -> 3
        row(output=[1, 1, 1], min_tokens=3, temperature=0.0),  # min reached -> eos
        row(output=[], min_tokens=2, stop_token_ids=[3], temperature=0.0),  # eos and 3 masked -> 5
        row(output=[], min_tokens=2, ignore_eos=True, temperature=0.0),  # eos allowed
        row(output=[], min_tokens=2, ignore_eos=True, stop_token_ids=[EOS], temperature=0.0),  # stop id masked
        row(output=[], min_tokens=1, temperature=1.0, top_k=1),
    ]
    out = Sampler({EOS})(logits, rows)
    assert out.token_ids == [3, EOS, 5, EOS, 3, 3]
    # logprobs still describe the raw distribution
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs == pytest.approx([raw[0, t].item() for t in out.token_ids], abs=1e-5)


def test_min_tokens_never_samples_eos():
    torch.manual_seed(0)
    logits = torch.zeros(2000, 10)
    logits[:, EOS] = 3.0
    out = Sampler({EOS})(logits, [row(min_tokens=1) for _ in range(2000)])
    assert EOS not in out.token_ids


PROBS = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05])


@pytest.mark.parametrize(
    "kw, allowed",
    [
        (dict(), [0, 1, 2, 3, 4]),
        (dict(top_k=2), [0, 1]),
        (dict(top_p=0.75), [0, 1, 2]),
        (dict(top_p=0.3), [0]),
        (dict(min_p=0.3), [0, 1, 2]),
        (dict(min_p=0.5), [0, 1]),
        (dict(top_k=3, top_p=0.6), [0, 1]),  # top_p on the renormalised top-3: [.47, .35, .18]
        (dict(top_k=4, min_p=0.3), [0, 1, 2]),
    ],
)
def test_filters_allowed_set_and_frequencies(kw, allowed):
    torch.manual_seed(1)
    n = 20000
    logits = PROBS.log().expand(n, -1).contiguous()
    # interleave with unfiltered rows: a filter disabled on a row leaves it untouched
    rows = [row(**kw) if i % 2 == 0 else row() for i in range(n)]
    toks = torch.tensor(Sampler()(logits, rows).token_ids)
    filtered, free = toks[0::2], toks[1::2]
    assert set(filtered.tolist()) <= set(allowed)
    expect = torch.zeros(5)
    expect[allowed] = PROBS[allowed] / PROBS[allowed].sum()
    assert torch.allclose(counts(filtered.tolist(), 5), expect, atol=0.02)
    assert torch.allclose(counts(free.tolist(), 5), PROBS, atol=0.02)


def test_temperature_distribution():
    torch.manual_seed(2)
    n = 20000
    logits = PROBS.log().expand(n, -1).contiguous()
    toks = Sampler()(logits, [row(temperature=2.0) for _ in range(n)]).token_ids
    assert torch.allclose(counts(toks, 5), torch.softmax(PROBS.log() / 2.0, -1), atol=0.02)


@pytest.mark.parametrize("top_p", [1.0, 0.9])  # top_k alone takes the no-sort path
def test_top_k_never_outside_with_random_logits(top_p):
    torch.manual_seed(3)
    vocab = 64
    logits = torch.randn(400, vocab) * 3
    ks = [1, 5, 17, vocab, 1000, -1, 0, 2] * 50
    rows = [row(temperature=1.5, top_k=k, top_p=top_p) for k in ks]
    seen = [set() for _ in ks]
    for _ in range(10):
        for i, t in enumerate(Sampler()(logits, rows).token_ids):
            seen[i].add(t)
    for i, k in enumerate(ks):
        allowed = set(logits[i].topk(min(k, vocab) if k > 0 else vocab).indices.tolist())
        assert seen[i] <= allowed
    assert max(len(x) for x, k in zip(seen, ks) if k in (vocab, 1000, -1, 0)) > 5  # disabled rows unrestricted


def test_seeded_rows_independent_of_batch():
    torch.manual_seed(4)
    vocab = 50
    logits_a = torch.randn(5, vocab)
    logits_b = torch.randn(5, vocab)

    kws = [dict(temperature=0.9, top_p=0.9), dict(temperature=1.2, top_k=10, presence_penalty=0.5)]
    alone = {}
    for j, kw in enumerate(kws):
        gen = torch.Generator().manual_seed(100 + j)
        toks = []
        for step in range(5):
            r = SamplingRow(SamplingParams(**kw), [1, 2], toks.copy(), gen)
            toks.append(Sampler()(logits_a[step : step + 1], [r]).token_ids[0])
        alone[j] = toks

    for order in (0, 1):
        gens = [torch.Generator().manual_seed(100 + j) for j in range(2)]
        got = {0: [], 1: []}
        for step in range(5):
            seeded = [(j, SamplingRow(SamplingParams(**kws[j]), [1, 2], got[j].copy(), gens[j])) for j in range(2)]
            others = [
                (None, row(temperature=1.0)),
                (None, row(temperature=0.0, repetition_penalty=1.5, output=[3])),
                (None, row(seed=7, temperature=0.5)),
            ]
            batch = seeded + others if order == 0 else others[::-1] + seeded[::-1]
            logits = torch.stack([logits_a[step] if j is not None else logits_b[step] for j, _ in batch])
            out = Sampler()(logits, [r for _, r in batch])
            for (j, _), t in zip(batch, out.token_ids):
                if j is not None:
                    got[j].append(t)
        assert got == alone


def test_same_seed_same_tokens_different_seed_differs():
    logits = torch.zeros(1, 1000)
    a = [Sampler()(logits, [row(seed=s)]).token_ids[0] for s in (1, 1, 2, 3, 4)]
    assert a[0] == a[1] and len(set(a[1:])) > 1


def test_logprobs_and_ranks():
    torch.manual_seed(5)
    logits = torch.randn(4, 30) * 2
    order = logits.argsort(-1, descending=True)
    # row 0: force the 4th-ranked token via min_tokens banning the top 3 (as stop tokens)
    rows = [
        row(output=[], min_tokens=1, stop_token_ids=order[0, :3].tolist(), temperature=0.0, logprobs=2),
        row(temperature=0.0, logprobs=3),
        row(temperature=0.8, logprobs=0),
        row(temperature=0.8),
    ]
    out = Sampler()(logits, rows)
    ref = torch.log_softmax(logits, -1)
    assert out.token_ids[0] == order[0, 3].item()
    for i, t in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(ref[i, t].item(), abs=1e-5)

    top0 = out.top_logprobs[0]
    assert list(top0) == [order[0, 3].item(), order[0, 0].item(), order[0, 1].item()]  # chosen first
    assert [lp.rank for lp in top0.values()] == [4, 1, 2]
    for t, lp in top0.items():
        assert lp.logprob == pytest.approx(ref[0, t].item(), abs=1e-5)

    top1 = out.top_logprobs[1]  # greedy: chosen is rank 1 and part of the top 3
    assert list(top1) == order[1, :3].tolist()
    assert [lp.rank for lp in top1.values()] == [1, 2, 3]

    top2 = out.top_logprobs[2]  # logprobs=0: only the chosen token
    (t2, lp2), = top2.items()
    assert t2 == out.token_ids[2]
    assert lp2.rank == int((ref[2] > ref[2, t2]).sum()) + 1
    assert lp2.logprob == pytest.approx(ref[2, t2].item(), abs=1e-5)
    assert out.top_logprobs[3] is None


def test_greedy_fast_path_logprobs():
    torch.manual_seed(6)
    logits = torch.randn(3, 40).to(torch.bfloat16)
    out = Sampler()(logits, [row(temperature=0.0, logprobs=5), row(temperature=0.0), row(temperature=0.0, logprobs=1)])
    ref = torch.log_softmax(logits.float(), -1)
    assert out.top_logprobs[1] is None
    for i in (0, 2):
        top = out.top_logprobs[i]
        k = (5, None, 1)[i]
        assert list(top) == ref[i].topk(k).indices.tolist()
        assert [lp.rank for lp in top.values()] == list(range(1, k + 1))
        assert [lp.logprob for lp in top.values()] == pytest.approx(ref[i].topk(k).values.tolist(), abs=1e-5)


def test_prompt_logprobs(monkeypatch):
    monkeypatch.setattr(sampler_mod, "_PROMPT_LOGPROBS_CHUNK", 3)  # exercise chunking
    torch.manual_seed(7)
    logits = torch.randn(7, 25).half()
    targets = [3, 0, 24, 5, 5, 1, 9]
    ref = torch.log_softmax(logits.float(), -1)
    for k in (0, 2):
        res = prompt_logprobs(logits, targets, k)
        assert len(res) == 7
        for t, (tgt, entry) in enumerate(zip(targets, res)):
            assert next(iter(entry)) == tgt
            assert entry[tgt].logprob == pytest.approx(ref[t, tgt].item(), abs=1e-5)
            topk = ref[t].topk(k)
            if tgt not in topk.indices.tolist():
                assert entry[tgt].rank == int((ref[t] > ref[t, tgt]).sum()) + 1
            assert len(entry) == k + (tgt not in topk.indices.tolist())
            for r, (tok, val) in enumerate(zip(topk.indices.tolist(), topk.values.tolist())):
                assert entry[tok].rank == r + 1 and entry[tok].logprob == pytest.approx(val, abs=1e-5)
    assert math.isclose(sum(math.exp(v.logprob) for v in prompt_logprobs(logits[:1], [0], 25)[0].values()), 1.0,
                        rel_tol=1e-4)


def test_counts_matches_naive():
    torch.manual_seed(8)
    lists = [torch.randint(0, 12, (n,)).tolist() for n in (0, 1, 7, 30)] + [[3, 11, 12, 99]]  # ids >= vocab dropped
    got = sampler_mod._counts(lists, 12, torch.device("cpu"))
    want = torch.stack([torch.bincount(torch.tensor([t for t in ids if t < 12], dtype=torch.long), minlength=12)
                        for ids in lists]).float()
    assert torch.equal(got, want)


# ---- the argmax + logsumexp kernel (sampling/csrc/logits.cpp), every ISA build this CPU runs -------------------

def _logits_kernel_or_skip(march):
    import platform
    import shutil

    from pagedlm.cpu import cpu_features
    from pagedlm.sampling import logits_kernel

    flags = cpu_features().flags
    avx2 = {"avx2", "fma", "f16c"} <= flags and platform.machine() == "x86_64"
    runs = {"native": True, "haswell": avx2, "x86-64": platform.machine() == "x86_64",
            cbuild.EMULATED_AVX512: avx2 and cbuild.emulation_available()}[march]
    if shutil.which("g++") is None or not runs:
        pytest.skip(f"no g++, or this CPU cannot run a -march={march} build")
    lib = logits_kernel.kernel_variant(march).load()
    assert lib is not None
    expected = {"native": 512 if "avx512f" in flags else 256 if {"avx2", "fma"} <= flags else 0,
                "haswell": 256, "x86-64": 0, cbuild.EMULATED_AVX512: 512}[march]
    assert lib.pagedlm_logits_isa() == expected
    return lib


@pytest.mark.parametrize("march", ["native", "haswell", "x86-64", cbuild.EMULATED_AVX512])
def test_argmax_logsumexp_kernel_matches_torch(march):
    """Each build against torch.argmax / logsumexp: first index among exact ties (inside a vector, across
    vectors, in the tail), -inf entries, vocabularies that are not a multiple of the vector width, a row stride
    wider than the row, single rows and many."""
    from pagedlm.sampling.logits_kernel import argmax_logsumexp_kernel

    lib = _logits_kernel_or_skip(march)
    g = torch.Generator().manual_seed(3)
    for n, v in ((1, 49152), (64, 4099), (5, 7), (3, 17), (33, 160)):
        x = torch.randn(n, v, generator=g) * 4
        x[0, v // 3] = x[0, v - 1] = x[0].max() + 1  # tie: the first wins
        if n > 1:
            x[1, :] = -math.inf
            x[1, v // 2] = 0.5  # one finite entry among -inf
        if n > 2:
            x[2, :] = 2.0  # all equal: index 0
        tokens, lse = argmax_logsumexp_kernel(x, lib)
        assert torch.equal(tokens, x.argmax(-1)), (n, v)
        torch.testing.assert_close(lse, x.logsumexp(-1), atol=1e-5, rtol=1e-6)
        wide = torch.randn(n, v + 5, generator=g)[:, :v]  # rows v + 5 floats apart
        tokens, lse = argmax_logsumexp_kernel(wide, lib)
        assert torch.equal(tokens, wide.argmax(-1))
        torch.testing.assert_close(lse, wide.logsumexp(-1), atol=1e-5, rtol=1e-6)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_argmax_logsumexp_defers_rows_it_does_not_take_to_torch(bad):
    """A NaN or an infinite maximum: the kernel declines and the sampler's reductions are torch's own."""
    from pagedlm.sampling.logits_kernel import argmax_logsumexp, argmax_logsumexp_kernel

    lib = _logits_kernel_or_skip("native")
    x = torch.randn(4, 300)
    x[2, 77] = bad
    assert argmax_logsumexp_kernel(x, lib) is None
    tokens, lse = argmax_logsumexp(x)
    assert torch.equal(tokens, x.argmax(-1))
    assert torch.equal(lse.isnan(), x.logsumexp(-1).isnan()) and tokens[2] == 77


def test_greedy_sampler_runs_the_row_kernel(monkeypatch):
    """The greedy fast path takes its tokens and logprobs from the kernel (one call, no torch argmax)."""
    from pagedlm.sampling import logits_kernel

    _logits_kernel_or_skip("native")
    calls = []
    real = logits_kernel.argmax_logsumexp_kernel
    monkeypatch.setattr(logits_kernel, "argmax_logsumexp_kernel", lambda x, lib: calls.append(x.shape) or real(x, lib))
    monkeypatch.setattr(torch.Tensor, "argmax", lambda *a, **k: pytest.fail("torch argmax ran"))
    logits = torch.randn(8, 1000)
    out = Sampler()(logits, [row(temperature=0.0) for _ in range(8)])
    assert calls == [(8, 1000)]
    ref = torch.log_softmax(logits, -1)
    assert out.logprobs == pytest.approx([ref[i, t].item() for i, t in enumerate(out.token_ids)], abs=1e-5)
