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
