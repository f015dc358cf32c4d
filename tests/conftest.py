"""Shared fixtures. Real-model fixtures pull into the model cache ($PAGEDLM_CACHE) once."""

from __future__ import annotations

import functools
import os
import signal
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

_GGUF_READER = gguf.GGUFReader


class _PlainGGUFReader(_GGUF_READER):
    """gguf-py's reader over a plain ndarray view of its mapping: it slices out a view for every element of every
    metadata array, and an np.memmap's slicing costs three times a plain array's (Gemma 3's 262k-token vocabulary:
    14 s against 5 s). The same bytes, mapped the same way."""

    @property
    def data(self):
        return self._data

    @data.setter
    def data(self, value):
        self._data = value.view(np.ndarray)


class _SharedGGUFReader:
    """The reader above, one per real model file for the session. transformers reads a GGUF twice per
    `from_pretrained` (config, then weights) and parses every metadata value each time. The reader is read-only, so
    sharing it changes nothing but the time."""

    _reader = _PlainGGUFReader
    _cache: dict = {}

    def __new__(cls, path, mode="r"):
        st = Path(path).stat()
        if mode != "r":
            return _GGUF_READER(path, mode)
        if st.st_size < 32 << 20:  # the real models only; the tests' own small files read afresh
            return cls._reader(path, mode)
        key = (str(Path(path).resolve()), st.st_size, st.st_mtime_ns)
        if key not in cls._cache:
            cls._cache[key] = cls._reader(path, mode)
        return cls._cache[key]


gguf.GGUFReader = _SharedGGUFReader
# transformers builds gguf-py's tensor name map afresh for every module it walks while mapping names (397 times for
# SmolLM2: 11 s); the map is a pure function of the architecture and the layer count.
gguf.get_tensor_name_map = functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map)

TINY_SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
_TINY_CORPUS = """\
The quick brown fox jumps over the lazy dog. A paged key value cache stores attention keys and values in fixed size blocks, so that memory for many sequences can be shared and reused without fragmentation.
Once upon a time, there was a little girl who lived in a village near the forest. Whenever she went out, the little girl wore a red riding cloak, so everyone in the village called her Little Red Riding Hood.
It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, it was the season of Darkness.
The engine schedules requests, batches prompts together, and streams generated tokens back to each client as soon as they are sampled. Numbers like 1, 2, 3, 42 and 2024 appear in text too.
Hello! How are you today? I am fine, thank you. What is the capital of France? Paris is the capital of France. Please answer the question briefly and politely.
"""


def build_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Deterministic byte-level BPE (vocab 512; ids 0, 1, 2 = <|endoftext|>, <|im_start|>, <|im_end|>)
    with a ChatML chat template; eos is <|endoftext|>, there is no bos."""
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=TINY_SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    raw.train_from_iterator(_TINY_CORPUS.splitlines(), trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, eos_token="<|endoftext|>", model_max_length=512)
    tok.chat_template = TINY_CHAT_TEMPLATE
    return tok


def build_tiny_gemma3(path: Path, **config) -> Path:
    """A random Gemma 3 (64 hidden, 6 layers, head_dim 16) with nonzero norm weights, saved with the tiny
    tokenizer; `config` overrides Gemma3TextConfig fields (sliding_window, layer_types, ...)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    tok = build_tiny_tokenizer()
    cfg = Gemma3TextConfig(**{**dict(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=6,
                                     num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                     query_pre_attn_scalar=16, bos_token_id=None, eos_token_id=tok.eos_token_id,
                                     pad_token_id=None), **config})
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(0.0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


# the tiny LLaMA's LlamaConfig fields (besides vocab_size = the tiny tokenizer's 512, eos = its <|endoftext|>)
TINY_LLAMA = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=512, rope_theta=10000, tie_word_embeddings=True,
                  bos_token_id=None)


def _low_priority() -> None:
    """A process group of its own (to be killed whole) at nice 19, in this session: a new session would be a
    scheduler autogroup of its own, where its nice value does not count against the tests'."""
    os.setpgid(0, 0)
    os.nice(19)


@pytest.fixture(scope="session", autouse=True)
def _kernels_built_beside_the_tests(request):
    """For a run of most of the suite (over 200 tests), every kernel library it loads is compiled by a low-priority
    process beside the tests (kernel_prebuild.py): about two minutes of one core on a clean machine, overlapped
    with tests that leave a core idle instead of paid one build at a time by the first test of each."""
    proc = None
    if len(request.session.items) > 200 and not os.environ.get("PAGEDLM_DISABLE_CPU_KERNEL"):
        proc = subprocess.Popen([sys.executable, str(Path(__file__).with_name("kernel_prebuild.py"))],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=_low_priority)
    yield
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight 2-layer LLaMA (hidden 64, 4 heads, 2 KV heads, tied embeddings) in HF
    safetensors format, with the tiny tokenizer; loads offline with transformers."""
    path = tmp_path_factory.mktemp("tiny_llama")
    tok = build_tiny_tokenizer()
    config = LlamaConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=None, **TINY_LLAMA)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    """The real SmolLM2-135M-Instruct Q4_1 GGUF (pulled into the cache on first use)."""
    from pagedlm.hub.registry import resolve_model

    return resolve_model("smollm2-135m")


@pytest.fixture(scope="session")
def smollm2_hf(smollm2_path: Path):
    """HF transformers' SmolLM2, fp32, from the same GGUF through transformers' own loading code: the reference
    model of the parity, beam-search and weight tests (loaded once per session: loading takes ~30 s)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def gemma3_path() -> Path:
    """The real Gemma 3 270M (pretrained base) Q4_K_M GGUF (pulled into the cache on first use)."""
    from pagedlm.hub.registry import resolve_model

    return resolve_model("gemma3-270m")


@pytest.fixture(scope="session")
def tiny_2k_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random LLaMA with a 2048-token context (the built-in tool template's instructions alone take ~750
    tiny tokens) and untied embeddings (with tied ones a random model's greedy answer repeats the prompt's last
    token: every chat would answer newlines), with the tiny tokenizer and its ChatML template (which knows no
    tools)."""
    path = tmp_path_factory.mktemp("tiny_llama_2k")
    tok = build_tiny_tokenizer()
    tok.model_max_length = 2048
    config = LlamaConfig(vocab_size=len(tok), eos_token_id=tok.eos_token_id, pad_token_id=None,
                         **{**TINY_LLAMA, "max_position_embeddings": 2048, "tie_word_embeddings": False})
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path
