"""Random-weight GGUFs shaped like the families beyond LLaMA that people run, with SmolLM2's tokenizer (its token
list padded to the embedding's rows, as llama.cpp's converter pads Qwen's), written as F16 and quantized by
llama.cpp's own quantizer (`../shared/tools/make-scale-model.py` does the same for LLaMA shapes), so pagedlm and
llama.cpp load the same file. Speed does not depend on the values.

- `qwen2-0.5b`, `qwen2-1.5b`: Qwen2.5 (llama.cpp's `qwen2`: q/k/v biases, a tied embedding of 151,936 rows);
- `qwen3-0.6b`, `qwen3-4b`: Qwen3 (`qwen3`: QK-norm, head_dim 128, a tied embedding);
- `smollm3-3b`: SmolLM3-3B (`smollm3`: a NoPE layer every 4, a tied embedding of 128,256 rows);
- `qwen2moe-a2.7b`: Qwen1.5-MoE-A2.7B (`qwen2moe`: 60 experts of 1,408, 4 a token, a shared expert of 5,632);
- `qwen3moe-30b-a3b`: Qwen3-30B-A3B (`qwen3moe`: 128 experts of 768, 8 per token, QK-norm, head_dim 128), whose
  48 layers `--layers` may cut (12: a quarter of the weights per token and in the file);
- `olmoe-1b-7b`: OLMoE-1B-7B (`olmoe`: 64 experts of 1,024, 8 per token, not renormalized; QK-norm over the whole
  q / k projections);
- `gemma3-1b`, `gemma3-4b`: Gemma 3 (`gemma3`: head_dim 256, QK-norm, norms after attention and MLP, GELU, five
  sliding-window layers to one global, a tied embedding of 262,144 rows), with Gemma 3 270M's tokenizer
  (`--tokenizer-from` defaults to it); the 4B's linear RoPE scaling of its global layers is left out (speed does not
  depend on it).

    .venv/bin/python benchmarks/family_shape.py qwen2-0.5b Q4_K_M ~/.cache/pagedlm/scale/random-qwen2-0.5b-Q4_K_M.gguf
    .venv/bin/python benchmarks/decode_duel.py ~/.cache/pagedlm/scale/random-qwen2-0.5b-Q4_K_M.gguf --rounds 6
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants

MAKE_MODEL = Path(__file__).resolve().parents[2] / "shared" / "tools" / "make-scale-model.py"
@dataclass(frozen=True)
class Shape:
    arch: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    head_dim: int = 0  # 0: hidden / heads
    experts: int = 0
    experts_used: int = 0
    shared_ffn: int = 0  # a shared expert of this width (Qwen2-MoE)
    tied: bool = True
    vocab: int = 151936  # Qwen's
    rope_theta: float = 1000000.0
    window: int = 0  # Gemma 3's sliding window


SHAPES = {
    "qwen2-0.5b": Shape("qwen2", 896, 24, 14, 2, 4864),
    "qwen2-1.5b": Shape("qwen2", 1536, 28, 12, 2, 8960),
    "qwen3-0.6b": Shape("qwen3", 1024, 28, 16, 8, 3072, head_dim=128),
    "qwen3-4b": Shape("qwen3", 2560, 36, 32, 8, 9728, head_dim=128),
    "smollm3-3b": Shape("smollm3", 2048, 36, 16, 4, 11008, vocab=128256, rope_theta=5000000.0),
    "qwen2moe-a2.7b": Shape("qwen2moe", 2048, 24, 16, 16, 1408, experts=60, experts_used=4, shared_ffn=5632,
                            tied=False),
    "qwen3moe-30b-a3b": Shape("qwen3moe", 2048, 48, 32, 4, 768, head_dim=128, experts=128, experts_used=8,
                              tied=False),
    "olmoe-1b-7b": Shape("olmoe", 2048, 16, 16, 16, 1024, experts=64, experts_used=8, tied=False, vocab=50304,
                         rope_theta=10000.0),
    "gemma3-1b": Shape("gemma3", 1152, 26, 4, 1, 6912, head_dim=256, vocab=262144, window=512),
    "gemma3-4b": Shape("gemma3", 2560, 34, 8, 4, 10240, head_dim=256, vocab=262144, window=1024),
}
UNUSED = 5  # llama.cpp's token type of padding tokens


def _scale_tool():
    spec = importlib.util.spec_from_file_location("make_scale_model", MAKE_MODEL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write(shape: Shape, out: str, tokenizer_from: str, blocks: str | None = None) -> None:
    """F16, or with `blocks` (Q8_0, Q4_0) those blocks written by gguf-py directly: each tensor shape drawn and
    quantized once and its bytes repeated in every layer, so a 30B-parameter file takes minutes, not an hour."""
    tool = _scale_tool()
    d = shape.head_dim or shape.hidden // shape.heads
    tok = {k: tool._value(f) for k, f in GGUFReader(tokenizer_from).fields.items() if k.startswith("tokenizer.")}
    tokens, types = tok["tokenizer.ggml.tokens"], tok["tokenizer.ggml.token_type"]
    pad = shape.vocab - len(tokens)
    w = GGUFWriter(out, shape.arch)
    w.add_name(f"random-{shape.arch}")
    w.add_context_length(32768)
    w.add_embedding_length(shape.hidden)
    w.add_block_count(shape.layers)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_key_length(d)
    w.add_value_length(d)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(shape.rope_theta)
    if shape.window:
        w.add_sliding_window(shape.window)
    if shape.experts:
        w.add_expert_count(shape.experts)
        w.add_expert_used_count(shape.experts_used)
        w.add_expert_feed_forward_length(shape.ffn)
        w.add_expert_weights_norm(shape.arch not in ("qwen2moe", "olmoe"))
        if shape.shared_ffn:
            w.add_expert_shared_feed_forward_length(shape.shared_ffn)
    w.add_file_type({None: 1, "Q4_0": 2, "Q8_0": 7}[blocks])
    w.add_tokenizer_model(tok["tokenizer.ggml.model"])
    if "tokenizer.ggml.pre" in tok:
        w.add_tokenizer_pre(tok["tokenizer.ggml.pre"])
    w.add_token_list([*tokens, *(f"[PAD{i}]" for i in range(pad))])
    w.add_token_types([*types, *([UNUSED] * pad)])
    if "tokenizer.ggml.merges" in tok:  # BPE
        w.add_token_merges(tok["tokenizer.ggml.merges"])
    if "tokenizer.ggml.scores" in tok:  # SentencePiece
        w.add_token_scores([*tok["tokenizer.ggml.scores"], *([0.0] * pad)])
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                     ("padding_token_id", w.add_pad_token_id), ("unknown_token_id", w.add_unk_token_id)):
        if f"tokenizer.ggml.{key}" in tok:
            add(int(tok[f"tokenizer.ggml.{key}"]))
    for key, add in (("add_bos_token", w.add_add_bos_token), ("add_eos_token", w.add_add_eos_token),
                     ("add_space_prefix", w.add_add_space_prefix)):
        if f"tokenizer.ggml.{key}" in tok:
            add(bool(tok[f"tokenizer.ggml.{key}"]))
    if "tokenizer.chat_template" in tok:
        w.add_chat_template(tok["tokenizer.chat_template"])
    rng = np.random.default_rng(0)

    drawn: dict[tuple, np.ndarray] = {}

    def tensor(name, *dims, scale=0.02, offset=0.0, dtype=np.float16):
        if blocks is None or dtype != np.float16:
            w.add_tensor(name, (offset + scale * rng.standard_normal(dims, dtype=np.float32)).astype(dtype))
            return
        kind = GGMLQuantizationType[blocks]
        if dims not in drawn:
            drawn[dims] = quants.quantize(scale * rng.standard_normal(dims, dtype=np.float32), kind)
        w.add_tensor(name, drawn[dims], raw_dtype=kind)

    def norm(name, n):
        tensor(name, n, scale=0.01, offset=1.0, dtype=np.float32)

    tensor("token_embd.weight", shape.vocab, shape.hidden)
    for i in range(shape.layers):
        norm(f"blk.{i}.attn_norm.weight", shape.hidden)
        for proj, rows in (("q", shape.heads * d), ("k", shape.kv_heads * d), ("v", shape.kv_heads * d)):
            tensor(f"blk.{i}.attn_{proj}.weight", rows, shape.hidden)
            if shape.arch in ("qwen2", "qwen2moe"):
                tensor(f"blk.{i}.attn_{proj}.bias", rows, scale=0.5, dtype=np.float32)
        if shape.arch in ("qwen3", "qwen3moe", "gemma3"):
            norm(f"blk.{i}.attn_q_norm.weight", d)
            norm(f"blk.{i}.attn_k_norm.weight", d)
        elif shape.arch == "olmoe":  # over the whole projections
            norm(f"blk.{i}.attn_q_norm.weight", shape.heads * d)
            norm(f"blk.{i}.attn_k_norm.weight", shape.kv_heads * d)
        tensor(f"blk.{i}.attn_output.weight", shape.hidden, shape.heads * d)
        if shape.arch == "gemma3":
            norm(f"blk.{i}.post_attention_norm.weight", shape.hidden)
            norm(f"blk.{i}.post_ffw_norm.weight", shape.hidden)
        norm(f"blk.{i}.ffn_norm.weight", shape.hidden)
        if shape.experts:
            tensor(f"blk.{i}.ffn_gate_inp.weight", shape.experts, shape.hidden, dtype=np.float32)
            tensor(f"blk.{i}.ffn_gate_exps.weight", shape.experts, shape.ffn, shape.hidden)
            tensor(f"blk.{i}.ffn_up_exps.weight", shape.experts, shape.ffn, shape.hidden)
            tensor(f"blk.{i}.ffn_down_exps.weight", shape.experts, shape.hidden, shape.ffn)
            if shape.shared_ffn:
                tensor(f"blk.{i}.ffn_gate_inp_shexp.weight", shape.hidden, dtype=np.float32)
                tensor(f"blk.{i}.ffn_gate_shexp.weight", shape.shared_ffn, shape.hidden)
                tensor(f"blk.{i}.ffn_up_shexp.weight", shape.shared_ffn, shape.hidden)
                tensor(f"blk.{i}.ffn_down_shexp.weight", shape.hidden, shape.shared_ffn)
        else:
            tensor(f"blk.{i}.ffn_gate.weight", shape.ffn, shape.hidden)
            tensor(f"blk.{i}.ffn_up.weight", shape.ffn, shape.hidden)
            tensor(f"blk.{i}.ffn_down.weight", shape.hidden, shape.ffn)
        print(f"\rlayer {i + 1}/{shape.layers}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    norm("output_norm.weight", shape.hidden)
    if not shape.tied:
        tensor("output.weight", shape.vocab, shape.hidden)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=SHAPES)
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the model has")
    ap.add_argument("quant", help="F16, Q8_0 or Q4_0 (written by gguf-py, each tensor shape drawn once), or another "
                    "llama.cpp quantization type (Q4_K_M, ...: F16 first, then llama.cpp's quantizer)")
    ap.add_argument("out")
    ap.add_argument("--tokenizer-from", default=None, help="a GGUF whose tokenizer the file takes (default: "
                    "SmolLM2's, Gemma 3 270M's for Gemma 3 shapes)")
    a = ap.parse_args()
    cache = Path.home() / ".cache/pagedlm"
    a.tokenizer_from = a.tokenizer_from or str(cache / ("gemma-3-270m-q4_k_m.gguf" if a.shape.startswith("gemma3")
                                                        else "SmolLM2-135M-Instruct.Q4_1.gguf"))
    shape = SHAPES[a.shape] if a.layers is None else replace(SHAPES[a.shape], layers=a.layers)
    if a.quant in ("F16", "Q8_0", "Q4_0"):
        write(shape, a.out, a.tokenizer_from, None if a.quant == "F16" else a.quant)
        return
    f16 = a.out + ".f16.tmp"
    try:
        write(shape, f16, a.tokenizer_from)
        _scale_tool().llama_cpp_quantize(f16, a.out, a.quant)
    finally:
        Path(f16).unlink(missing_ok=True)
    print(a.out, file=sys.stderr)


if __name__ == "__main__":
    main()
