"""The `pagedlm` command line: memory arithmetic for any config, generate on the tiny model."""
from __future__ import annotations

import json

from pagedlm.cli import main

LLAMA_70B = {
    "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
    "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
}


def test_memory_for_bare_hf_config(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA_70B))
    assert main(["memory", "--model", str(cfg), "--dtype", "bfloat16", "--kv-cache-memory", "40GiB",
                 "--max-model-len", "8192", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["kv_bytes_per_token"] == 2 * 80 * 8 * 128 * 2 == 327_680  # 320 KiB per token
    assert r["num_blocks"] == 40 * 2**30 // (327_680 * 16)
    assert r["tokens_capacity"] == r["num_blocks"] * 16
    assert abs(r["max_concurrency"] - r["num_blocks"] / 512) < 1e-9


def test_memory_human_readable(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA_70B))
    main(["memory", "--model", str(cfg), "--dtype", "bfloat16"])
    out = capsys.readouterr().out
    assert "2 x 80 layers x 8 kv_heads x 128 head_dim x 2 B" in out and "320.0 KiB" in out


def test_generate_on_tiny_model(tiny_model_dir, capsys):
    assert main(["generate", "Hello!", "--model", str(tiny_model_dir), "--max-tokens", "5", "--num-kv-blocks",
                 "32"]) == 0
    assert capsys.readouterr().out.strip() != ""


def test_unknown_model_is_a_clear_error(capsys):
    assert main(["memory", "--model", "no-such-model"]) == 2
    assert "expected a known model name" in capsys.readouterr().err


def test_memory_with_quantized_kv_cache(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(LLAMA_70B))
    assert main(["memory", "--model", str(cfg), "--kv-cache-dtype", "int8", "--kv-cache-memory", "40GiB",
                 "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["kv_bytes_per_token"] == 2 * 80 * 8 * (128 + 4) and r["scale_bytes"] == 4  # values + fp32 scale


def test_generate_quantized_and_bad_flags(tiny_model_dir, capsys):
    assert main(["generate", "Hello!", "--model", str(tiny_model_dir), "--max-tokens", "5", "--num-kv-blocks", "32",
                 "--quantization", "int8", "--kv-cache-dtype", "fp8_e4m3"]) == 0
    assert capsys.readouterr().out.strip() != ""
    assert main(["generate", "Hello!", "--model", str(tiny_model_dir), "--quantization", "int4",
                 "--quantization-group-size", "48"]) == 2
    assert "group size" in capsys.readouterr().err


GEMMA3_270M = {
    "model_type": "gemma3_text", "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144,
    "max_position_embeddings": 32768, "sliding_window": 512, "query_pre_attn_scalar": 256,
}


def test_memory_separates_sliding_window_layers(tmp_path, capsys):
    """Gemma 3 270M: 3 global layers grow with the sequence, 15 sliding layers keep 512 tokens (+ a block)."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(GEMMA3_270M))
    assert main(["memory", "--model", str(cfg), "--dtype", "bfloat16", "--kv-cache-memory", "2GiB",
                 "--max-model-len", "32768", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["full_layers"], r["sliding_layers"], r["sliding_window"]) == (3, 15, 512)
    assert r["full_bytes_per_token"] == 2 * 3 * 256 * 2 and r["sliding_bytes_per_token"] == 2 * 15 * 256 * 2
    assert (r["layers_per_block"], r["num_groups"]) == (3, 6) and r["bytes_per_block"] == 2 * 3 * 256 * 2 * 16
    assert r["num_blocks"] == 2 * 2**30 // r["bytes_per_block"]
    assert r["sliding_bytes_per_seq"] == 5 * (512 // 16 + 1) * r["bytes_per_block"]
    assert abs(r["max_concurrency"] - r["num_blocks"] / (2048 + 5 * 33)) < 1e-9
    assert abs(r["max_concurrency_without_freeing"] - r["num_blocks"] / (6 * 2048)) < 1e-9
    assert r["max_concurrency"] > 5 * r["max_concurrency_without_freeing"]
    main(["memory", "--model", str(cfg), "--dtype", "bfloat16"])
    out = capsys.readouterr().out
    assert "sliding window   : 15 layers" in out and "if sliding-window blocks were kept" in out


MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "num_experts_per_tok": 2, "vocab_size": 32000, "max_position_embeddings": 32768, "rms_norm_eps": 1e-5,
    "rope_theta": 1e6, "sliding_window": None, "tie_word_embeddings": False,
}


def test_memory_counts_every_expert(tmp_path, capsys):
    """Mixtral 8x7B: 46.7B parameters (all experts), KV as for its 32 layers x 8 KV heads."""
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(MIXTRAL_8X7B))
    assert main(["memory", "--model", str(cfg), "--dtype", "bfloat16", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["weight_params"] == 46_702_792_704 and r["weight_bytes"] == 2 * 46_702_792_704
    assert (r["num_experts"], r["moe_layers"], r["kv_bytes_per_token"]) == (8, 32, 2 * 32 * 8 * 128 * 2)
    main(["memory", "--model", str(cfg), "--dtype", "bfloat16"])
    assert "46,702.8M parameters, all 8 experts of 32 MoE layers = 87.0 GiB" in capsys.readouterr().out
    cfg.write_text(json.dumps({**MIXTRAL_8X7B, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
                               "sliding_window": 4096, "num_local_experts": None}))
    assert main(["memory", "--model", str(cfg), "--dtype", "bfloat16", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["sliding_layers"] == 32 and r["sliding_window"] == 4096 and r["num_experts"] == 0
