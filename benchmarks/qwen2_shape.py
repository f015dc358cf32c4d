"""A random-weight GGUF shaped like Qwen2.5 (llama.cpp's `qwen2` architecture: q/k/v biases, a tied embedding of
151,936 rows) with SmolLM2's tokenizer (its token list padded to the embedding's rows, as llama.cpp's converter pads
Qwen's), written as F16 and quantized by llama.cpp's own quantizer (`../shared/tools/make-scale-model.py` does the
same for LLaMA shapes), so pagedlm and llama.cpp load the same file. Speed does not depend on the values.

    .venv/bin/python benchmarks/qwen2_shape.py 0.5b Q4_K_M ~/.cache/pagedlm/scale/random-qwen2-0.5b-Q4_K_M.gguf
    .venv/bin/python benchmarks/decode_duel.py ~/.cache/pagedlm/scale/random-qwen2-0.5b-Q4_K_M.gguf --rounds 6
"""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader, GGUFWriter

MAKE_MODEL = Path(__file__).resolve().parents[2] / "shared" / "tools" / "make-scale-model.py"
SHAPES = {  # hidden, layers, heads, KV heads, FFN
    "0.5b": (896, 24, 14, 2, 4864),   # Qwen2.5-0.5B
    "1.5b": (1536, 28, 12, 2, 8960),  # Qwen2.5-1.5B
}
VOCAB = 151936
UNUSED = 5  # llama.cpp's token type of padding tokens


def _scale_tool():
    spec = importlib.util.spec_from_file_location("make_scale_model", MAKE_MODEL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_f16(shape: str, out: str, tokenizer_from: str) -> None:
    tool = _scale_tool()
    hidden, layers, heads, kv_heads, ffn = SHAPES[shape]
    head_dim = hidden // heads
    tok = {k: tool._value(f) for k, f in GGUFReader(tokenizer_from).fields.items() if k.startswith("tokenizer.")}
    tokens, types = tok["tokenizer.ggml.tokens"], tok["tokenizer.ggml.token_type"]
    pad = VOCAB - len(tokens)
    w = GGUFWriter(out, "qwen2")
    w.add_name(f"random-qwen2-{shape}")
    w.add_context_length(32768)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_freq_base(1000000.0)
    w.add_file_type(1)
    w.add_tokenizer_model(tok["tokenizer.ggml.model"])
    if "tokenizer.ggml.pre" in tok:
        w.add_tokenizer_pre(tok["tokenizer.ggml.pre"])
    w.add_token_list([*tokens, *(f"[PAD{i}]" for i in range(pad))])
    w.add_token_types([*types, *([UNUSED] * pad)])
    w.add_token_merges(tok["tokenizer.ggml.merges"])
    for key, add in (("bos_token_id", w.add_bos_token_id), ("eos_token_id", w.add_eos_token_id),
                     ("padding_token_id", w.add_pad_token_id)):
        if f"tokenizer.ggml.{key}" in tok:
            add(int(tok[f"tokenizer.ggml.{key}"]))
    if "tokenizer.chat_template" in tok:
        w.add_chat_template(tok["tokenizer.chat_template"])
    rng = np.random.default_rng(0)

    def tensor(name, *shape, scale=0.02, offset=0.0, dtype=np.float16):
        w.add_tensor(name, (offset + scale * rng.standard_normal(shape, dtype=np.float32)).astype(dtype))

    tensor("token_embd.weight", VOCAB, hidden)
    for i in range(layers):
        tensor(f"blk.{i}.attn_norm.weight", hidden, scale=0.01, offset=1.0, dtype=np.float32)
        for proj, rows in (("q", heads * head_dim), ("k", kv_heads * head_dim), ("v", kv_heads * head_dim)):
            tensor(f"blk.{i}.attn_{proj}.weight", rows, hidden)
            tensor(f"blk.{i}.attn_{proj}.bias", rows, scale=0.5, dtype=np.float32)
        tensor(f"blk.{i}.attn_output.weight", hidden, heads * head_dim)
        tensor(f"blk.{i}.ffn_norm.weight", hidden, scale=0.01, offset=1.0, dtype=np.float32)
        tensor(f"blk.{i}.ffn_gate.weight", ffn, hidden)
        tensor(f"blk.{i}.ffn_up.weight", ffn, hidden)
        tensor(f"blk.{i}.ffn_down.weight", hidden, ffn)
    tensor("output_norm.weight", hidden, scale=0.01, offset=1.0, dtype=np.float32)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=SHAPES)
    ap.add_argument("quant", help="F16, or a llama.cpp quantization type (Q4_K_M, Q8_0, ...)")
    ap.add_argument("out")
    ap.add_argument("--tokenizer-from", default=str(Path.home() / ".cache/pagedlm/SmolLM2-135M-Instruct.Q4_1.gguf"))
    a = ap.parse_args()
    if a.quant == "F16":
        write_f16(a.shape, a.out, a.tokenizer_from)
        return
    f16 = a.out + ".f16.tmp"
    try:
        write_f16(a.shape, f16, a.tokenizer_from)
        _scale_tool().llama_cpp_quantize(f16, a.out, a.quant)
    finally:
        Path(f16).unlink(missing_ok=True)
    print(a.out, file=sys.stderr)


if __name__ == "__main__":
    main()
