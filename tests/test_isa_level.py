"""PAGEDLM_ISA (cpu.py): an AVX-512 machine runs pagedlm as an AVX2-only CPU would (Zen 3): the flags the plan sees,
the kernels' -march, torch's and oneDNN's ISA; a real model at the AVX2 level keeps the native run's quality."""
from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from pagedlm import cbuild, cpu

ZEN4 = frozenset("fpu sse2 avx avx2 fma f16c bmi2 avx512f avx512dq avx512bw avx512vl avx512_vnni avx512_bf16 "
                 "avx512vbmi avx512_vbmi2 avx512ifma gfni vaes".split())
SAPPHIRE_RAPIDS = ZEN4 | {"amx_tile", "amx_int8", "amx_bf16", "avx_vnni", "avx512_fp16"}


@pytest.fixture
def isa(monkeypatch):
    """Sets PAGEDLM_ISA for the test (cpu_features is cached per process: cleared before and after)."""
    def set_level(level: str | None) -> None:
        if level is None:
            monkeypatch.delenv("PAGEDLM_ISA", raising=False)
        else:
            monkeypatch.setenv("PAGEDLM_ISA", level)
        cpu.cpu_features.cache_clear()

    yield set_level
    monkeypatch.delenv("PAGEDLM_ISA", raising=False)
    cpu.cpu_features.cache_clear()


def test_avx2_level_hides_what_an_avx2_cpu_lacks():
    for flags in (ZEN4, SAPPHIRE_RAPIDS):
        seen = cpu.limit_flags(flags, "avx2")
        assert {"avx2", "fma", "f16c", "bmi2", "avx"} <= seen
        assert not {f for f in seen if f.startswith(("avx512", "amx", "avx_"))}
        assert not cpu.CpuFeatures(seen).native_bf16
        assert cpu.limit_flags(flags, "native") == flags
    with pytest.raises(ValueError, match="no AVX2"):
        cpu.limit_flags(frozenset({"sse2", "avx"}), "avx2")


def test_isa_level_is_validated(isa):
    isa("AVX2 ")
    assert cpu.isa_level() == "avx2"
    isa("avx512")
    with pytest.raises(ValueError, match="PAGEDLM_ISA must be one of native, avx2"):
        cpu.isa_level()
    isa(None)
    assert cpu.isa_level() == "native" and cpu.kernel_march() == "native"


@pytest.mark.skipif(not {"avx2", "fma"} <= cpu.cpu_flags(), reason="the AVX2 level needs an AVX2 CPU")
def test_avx2_level_builds_haswell_kernels(isa):
    isa(None)  # the suite may run at PAGEDLM_ISA=avx2
    native = cbuild.flags()
    isa("avx2")
    assert "-march=haswell" in cbuild.flags() and "-march=native" in native
    assert not {f for f in cpu.cpu_features().flags if f.startswith("avx512")}
    # An explicit target is kept (the tests' AVX2 and portable builds), and the cache key of a haswell build does
    # not depend on the level: tests and PAGEDLM_ISA=avx2 share it.
    assert cbuild.flags("x86-64") == [f.replace("-march=native", "-march=x86-64") for f in native]
    source = Path(cbuild.__file__).parent / "model" / "csrc" / "quant_linear.cpp"
    key = cbuild.cache_key(source, cbuild.compiler(), "native")
    isa(None)
    assert key == cbuild.cache_key(source, cbuild.compiler(), "haswell") != cbuild.cache_key(source, cbuild.compiler())


RUN = """
import json, sys, torch
from pathlib import Path
from pagedlm import LLM, cbuild
from pagedlm.attention import cpu_kernel
from pagedlm.bench.quality import token_logprobs
from pagedlm.hub.tokenizer import load_tokenizer
from pagedlm.model.quant import kernel
path, text = Path(sys.argv[1]), Path(sys.argv[2])
logprobs = token_logprobs(LLM(str(path)), load_tokenizer(path).encode(text.read_text())[:TOKENS])
haswell = cbuild.cache_key(kernel.SOURCE, cbuild.compiler(), "haswell")
print(json.dumps({"logprobs": logprobs, "torch": torch.backends.cpu.get_cpu_capability(),
                  "attention": cpu_kernel.attention_isa(cpu_kernel.load_kernel()),
                  "haswell_build": haswell in kernel.load_quant_kernel()._name}))
"""
TOKENS = 256
TEXT = Path(__file__).parent / "data" / "perplexity.txt"


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() != "x86_64" or not {"avx2", "fma", "f16c", "avx512f"} <= cpu.cpu_flags(),
                    reason="needs a CPU above the AVX2 level (on an AVX2-only CPU every other test runs its paths)")
def test_avx2_level_runs_gemma3_on_the_avx2_paths_at_the_native_quality(gemma3_path):
    """Gemma 3's Q4_K_M (Q4_K, Q5_0, Q6_K and Q8_0 blocks) in a process at PAGEDLM_ISA=avx2: haswell builds,
    torch at AVX2, the AVX2 attention loop; its mean negative log-likelihood of a text is this process's within
    5%. (Not equal: the attention loops differ by ~1e-5, and the activations' int8 rounding turns that into
    per-token log-probabilities ~0.1 apart, as far as either is from the fp32 path; measured 0.595 against 0.606.)"""
    from pagedlm import LLM
    from pagedlm.bench.quality import token_logprobs
    from pagedlm.hub.tokenizer import load_tokenizer

    res = subprocess.run([sys.executable, "-c", RUN.replace("TOKENS", str(TOKENS)), str(gemma3_path), str(TEXT)],
                         capture_output=True, text=True, timeout=600, env={**os.environ, "PAGEDLM_ISA": "avx2"})
    assert res.returncode == 0, res.stderr[-3000:]
    avx2 = json.loads(res.stdout.strip().splitlines()[-1])
    assert avx2["torch"] == "AVX2" and avx2["haswell_build"]
    assert avx2["attention"] == 256  # cpu_kernel.ISA_AVX2
    native = token_logprobs(LLM(str(gemma3_path)), load_tokenizer(gemma3_path).encode(TEXT.read_text())[:TOKENS])
    assert len(avx2["logprobs"]) == len(native) == TOKENS - 1
    nll = [-sum(lp) / len(lp) for lp in (avx2["logprobs"], native)]
    assert abs(nll[0] - nll[1]) < 0.05 * nll[1], nll
