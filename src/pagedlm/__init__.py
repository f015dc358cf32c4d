"""pagedlm: an LLM inference and serving engine built around a paged KV cache."""
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
