"""pagedlm: an LLM inference and serving engine built around a paged KV cache."""
import os as _os

# OpenMP (libgomp, read when torch loads it, so before torch is imported): after each parallel region the kernel
# threads spin-wait 300,000 rounds by default, about a millisecond. On a small machine that idle spinning takes the
# cores the server's event loop, the detokenizer and the clients need between steps (`pagedlm serve` at 16
# concurrent streams: 238 -> 384 tok/s with 20,000); 20,000 still covers the gaps between a step's kernels. An
# explicit GOMP_SPINCOUNT or OMP_WAIT_POLICY is left as it is.
if "GOMP_SPINCOUNT" not in _os.environ and "OMP_WAIT_POLICY" not in _os.environ:
    _os.environ["GOMP_SPINCOUNT"] = "20000"
# PAGEDLM_ISA=avx2 (cpu.py): torch's kernels and oneDNN's at AVX2 as well, read when torch loads.
if _os.environ.get("PAGEDLM_ISA", "").strip().lower() == "avx2":
    _os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
    _os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
from pagedlm.outputs import CompletionOutput, Logprob, RequestOutput
from pagedlm.sampling.params import SamplingParams

__all__ = ["LLM", "LLMEngine", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "EngineConfig"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from pagedlm.llm import LLM
        return LLM
    if name == "LLMEngine":
        from pagedlm.engine.llm_engine import LLMEngine
        return LLMEngine
    if name == "EngineConfig":
        from pagedlm.config import EngineConfig
        return EngineConfig
    raise AttributeError(name)
