"""The `pagedlm` command line: memory arithmetic for any config, generate on the tiny model."""
from __future__ import annotations

import argparse
import json
from dataclasses import fields

import pytest
import torch
from engine_utils import Steps

from pagedlm.cli import MEMORY_FIELDS, build_parser, engine_kwargs, main
from pagedlm.config import DEFAULT_MODEL, EngineConfig, LoopConfig, flag_name
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.sampling.params import SamplingParams
from pagedlm.sampling.sampler import Sampler, SamplingRow
from pagedlm.server.api import build_app
from pagedlm.server.cli import ServeConfig, ServerConfig, apply_config

LLAMA_70B = {
    "model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
    "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
}


def hf_config(tmp_path, config: dict) -> str:
    """`config` written to tmp_path/config.json; its path, for --model."""
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return str(path)


def memory_json(capsys, model: str, *flags: str) -> dict:
    """The report of `pagedlm memory --model MODEL FLAGS --json`."""
    assert main(["memory", "--model", model, *flags, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_memory_for_bare_hf_config(tmp_path, capsys):
    r = memory_json(capsys, hf_config(tmp_path, LLAMA_70B), "--dtype", "bfloat16", "--kv-cache-memory", "40GiB",
                    "--max-model-len", "8192")
    assert r["kv_bytes_per_token"] == 2 * 80 * 8 * 128 * 2 == 327_680  # 320 KiB per token
    assert r["num_blocks"] == 40 * 2**30 // (327_680 * 16)
    assert r["tokens_capacity"] == r["num_blocks"] * 16
    assert abs(r["max_concurrency"] - r["num_blocks"] / 512) < 1e-9


def test_memory_human_readable(tmp_path, capsys):
    main(["memory", "--model", hf_config(tmp_path, LLAMA_70B), "--dtype", "bfloat16"])
    out = capsys.readouterr().out
    assert "2 x 80 layers x 8 kv_heads x 128 head_dim x 2 B" in out and "320.0 KiB" in out


def test_generate_on_tiny_model(tiny_model_dir, capsys):
    assert main(["generate", "Hello!", "--model", str(tiny_model_dir), "--max-tokens", "5", "--num-kv-blocks",
                 "32"]) == 0
    assert capsys.readouterr().out.strip() != ""


def test_unknown_model_is_a_clear_error(capsys):
    assert main(["memory", "--model", "no-such-model"]) == 2
    assert "expected a known model name" in capsys.readouterr().err


def test_serve_takes_the_model_as_its_argument(tmp_path, capsys):
    """`pagedlm serve MODEL`, as `vllm serve MODEL`: the first model to serve, before any --model."""
    missing = tmp_path / "no-model.gguf"
    assert main(["serve", str(missing), "--port", "0"]) == 2
    assert f"'{missing}' does not exist" in capsys.readouterr().err
    assert main(["serve", str(missing), "--model", "smollm2-135m", "--served-model-name", "x", "--port", "0"]) == 2
    assert "--served-model-name needs exactly one --model" in capsys.readouterr().err


def test_memory_with_quantized_kv_cache(tmp_path, capsys):
    r = memory_json(capsys, hf_config(tmp_path, LLAMA_70B), "--kv-cache-dtype", "int8", "--kv-cache-memory", "40GiB")
    assert r["kv_bytes_per_token"] == 2 * 80 * 8 * (128 + 4) and r["scale_bytes"] == 4  # values + fp32 scale


def test_generate_quantized_and_bad_flags(tiny_model_dir, capsys):
    assert main(["generate", "Hello!", "--model", str(tiny_model_dir), "--max-tokens", "5", "--num-kv-blocks", "32",
                 "--quantization", "int8", "--kv-cache-dtype", "fp8_e4m3"]) == 0
    assert capsys.readouterr().out.strip() != ""
    assert main(["generate", "Hello!", "--model", str(tiny_model_dir), "--quantization", "int4",
                 "--quantization-group-size", "48"]) == 2
    assert "group size" in capsys.readouterr().err


def _adapter_gguf(path):
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_type("adapter")
    w.add_tensor("blk.0.attn_q.weight.lora_a", np.zeros((4, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_plausible_mistakes_are_one_line_errors(tiny_model_dir, tmp_path, capsys):
    """Each mistake ends with exit code 2 and one `error:` line naming it, before any model loads; each was a
    traceback (or, for --watermark 1, a hang: no request could ever be scheduled)."""
    from safetensors.torch import save_file

    (tmp_path / "bad.yaml").write_text("model: [unclosed\n")
    (tmp_path / "value.yaml").write_text("kv-cache-memory: banana\n")
    truncated = tmp_path / "truncated"  # a whole config.json beside a cut safetensors file
    truncated.mkdir()
    (truncated / "config.json").write_text(json.dumps(LLAMA_70B))
    (truncated / "model.safetensors").write_bytes(b"\x40\x00\x00\x00\x00\x00\x00\x00{")
    partial = tmp_path / "partial"  # a config.json without the model's shape
    partial.mkdir()
    (partial / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"x": torch.zeros(1)}, partial / "model.safetensors")
    gen = ["generate", "hi", "--model", str(tiny_model_dir)]
    cases = [
        ([*gen, "--watermark", "1"], "watermark must be in [0, 1)"),
        ([*gen, "--device", "tpu"], "device must be cpu, cuda or cuda:N"),
        ([*gen, "--max-model-len", "0"], "max_model_len must be >= 1"),
        (["serve", "--port", "99999"], "--port must be in 0-65535"),
        (["serve", "--port", "8766", "--ollama-port", "8766"], "--ollama-port must differ from --port"),
        (["serve", "--config", str(tmp_path / "bad.yaml")], "not valid YAML"),
        (["serve", "--config", str(tmp_path / "value.yaml")], "kv-cache-memory: Cannot parse a memory size"),
        (["serve", "--config", str(tmp_path)], "Is a directory"),
        (["memory", "--model", str(_adapter_gguf(tmp_path / "lora.gguf"))], "a GGUF adapter, not a model"),
        (["memory", "--model", str(truncated)], "not a readable safetensors file"),
        (["memory", "--model", str(partial)], "its config lacks 'hidden_size'"),
        (["memory", "--model", hf_config(tmp_path, {"model_type": "llama"})], "config lacks 'num_attention_heads'"),
        (["pull", str(tmp_path / "model.gguf")], "needs no pull"),
    ]
    if not torch.cuda.is_available():
        cases.append(([*gen, "--device", "cuda"], "torch sees no CUDA device"))
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert message in err and err.startswith("error: ") and "Traceback" not in err, (argv, err)


GEMMA3_270M = {
    "model_type": "gemma3_text", "hidden_size": 640, "intermediate_size": 2048, "num_hidden_layers": 18,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256, "vocab_size": 262144,
    "max_position_embeddings": 32768, "sliding_window": 512, "query_pre_attn_scalar": 256,
}


def test_memory_separates_sliding_window_layers(tmp_path, capsys):
    """Gemma 3 270M: 3 global layers grow with the sequence, 15 sliding layers keep 512 tokens (+ a block)."""
    cfg = hf_config(tmp_path, GEMMA3_270M)
    r = memory_json(capsys, cfg, "--dtype", "bfloat16", "--kv-cache-memory", "2GiB", "--max-model-len", "32768")
    assert (r["full_layers"], r["sliding_layers"], r["sliding_window"]) == (3, 15, 512)
    assert r["full_bytes_per_token"] == 2 * 3 * 256 * 2 and r["sliding_bytes_per_token"] == 2 * 15 * 256 * 2
    assert (r["layers_per_block"], r["num_groups"]) == (3, 6) and r["bytes_per_block"] == 2 * 3 * 256 * 2 * 16
    assert r["num_blocks"] == 2 * 2**30 // r["bytes_per_block"]
    assert r["sliding_bytes_per_seq"] == 5 * (512 // 16 + 1) * r["bytes_per_block"]
    assert abs(r["max_concurrency"] - r["num_blocks"] / (2048 + 5 * 33)) < 1e-9
    assert abs(r["max_concurrency_without_freeing"] - r["num_blocks"] / (6 * 2048)) < 1e-9
    assert r["max_concurrency"] > 5 * r["max_concurrency_without_freeing"]
    main(["memory", "--model", cfg, "--dtype", "bfloat16"])
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
    cfg = hf_config(tmp_path, MIXTRAL_8X7B)
    r = memory_json(capsys, cfg, "--dtype", "bfloat16")
    assert r["weight_params"] == 46_702_792_704 and r["weight_bytes"] == 2 * 46_702_792_704
    assert (r["num_experts"], r["moe_layers"], r["kv_bytes_per_token"]) == (8, 32, 2 * 32 * 8 * 128 * 2)
    main(["memory", "--model", cfg, "--dtype", "bfloat16"])
    assert "46,702.8M parameters, all 8 experts of 32 MoE layers = 87.0 GiB" in capsys.readouterr().out
    mistral = {**MIXTRAL_8X7B, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
               "sliding_window": 4096, "num_local_experts": None}
    r = memory_json(capsys, hf_config(tmp_path, mistral), "--dtype", "bfloat16")
    assert r["sliding_layers"] == 32 and r["sliding_window"] == 4096 and r["num_experts"] == 0


# --- flags from the config dataclasses -----------------------------------------------------------------------------
def _subparsers(parser):
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


def _engine_parsers():
    """Every `pagedlm` command that takes the engine flags."""
    sub = _subparsers(build_parser())
    bench = _subparsers(sub["bench"])
    return {"generate": sub["generate"], "serve": sub["serve"], "run-batch": sub["run-batch"],
            "bench throughput": bench["throughput"], "bench latency": bench["latency"]}


@pytest.mark.parametrize("command", ["generate", "serve", "run-batch", "bench throughput", "bench latency"])
def test_every_engine_field_is_a_flag_with_the_field_default(command):
    """The flags are EngineConfig's fields: names and defaults cannot drift apart (serve's --model repeats, and
    an absent one means the default model)."""
    parser = _engine_parsers()[command]
    actions = {a.dest: a for a in parser._actions}
    for f in fields(EngineConfig):
        assert flag_name(f.name) in actions[f.name].option_strings, f.name
        multi_model = command in ("serve", "run-batch") and f.name == "model"
        assert actions[f.name].default == (None if multi_model else f.default), f.name
        assert actions[f.name].help, f.name
    args = parser.parse_args({"generate": ["Hello"], "run-batch": ["-i", "in", "-o", "out"]}.get(command, []))
    assert EngineConfig(**engine_kwargs(args)) == EngineConfig()
    assert EngineConfig().model == DEFAULT_MODEL


def test_memory_takes_the_engine_flags_it_uses():
    actions = {a.dest: a for a in _subparsers(build_parser())["memory"]._actions}
    for name in MEMORY_FIELDS:
        assert actions[name].default == EngineConfig.__dataclass_fields__[name].default


def test_every_server_option_is_a_flag_with_the_field_default():
    actions = {a.dest: a for a in _engine_parsers()["serve"]._actions}
    for cls in ServeConfig.OPTIONS:  # the server's, the engine loops', the router's and the replicas' settings
        for f in fields(cls):
            assert flag_name(f.name) in actions[f.name].option_strings and actions[f.name].default == f.default, \
                f.name
    assert "-dp" in actions["data_parallel_size"].option_strings
    args = _engine_parsers()["serve"].parse_args(["--max-body-bytes", "1MiB", "-dp", "2", "--api-key", "a",
                                                  "--api-key", "b", "--prefix-cache-per-key", "--max-waiting", "7",
                                                  "--max-num-seqs", "3", "--router-name", "pick"])
    cfg = ServeConfig.from_args(args, engine_kwargs)
    assert (cfg.server.max_body_bytes, cfg.parallel.data_parallel_size, cfg.server.api_key,
            cfg.server.prefix_cache_per_key) == (2**20, 2, ["a", "b"], True)
    assert (cfg.loop.max_waiting, cfg.engine.max_num_seqs, cfg.router.router_name) == (7, 3, "pick")
    with pytest.raises(ValueError, match="max_waiting must be >= 1"):
        LoopConfig(max_waiting=0)
    with pytest.raises(ValueError, match="--max-body-bytes"):
        ServerConfig(max_body_bytes=0)


@pytest.mark.parametrize("flags, env", [(["--api-key", ""], None), (["--api-key", "k1", "--api-key", " "], None),
                                        ([], ""), ([], "k1,,k2")])
def test_empty_api_key_is_refused_at_start_up(flags, env, monkeypatch, capsys, tmp_path):
    """`--api-key "$KEY"` with KEY unset (or such a $PAGEDLM_API_KEY) is an error before anything loads: it used
    to turn authentication off while the start-up line said a key was required."""
    monkeypatch.delenv("PAGEDLM_API_KEY", raising=False)
    if env is not None:
        monkeypatch.setenv("PAGEDLM_API_KEY", env)
    assert main(["serve", "--model", str(tmp_path / "no-model"), "--port", "0", *flags]) == 2
    assert "empty API key" in capsys.readouterr().err
    with pytest.raises(ValueError, match="API key is empty"):
        build_app({"tiny": None}, api_key=["k1", " "] if flags else "")  # a library caller too


def test_engine_flags_parse_into_the_config():
    """Short aliases and old spellings keep working; bools go both ways; sizes and dtypes are checked when parsed."""
    parser = _engine_parsers()["generate"]
    args = parser.parse_args(["x", "-q", "int4", "--kv-cache-memory", "512MiB", "--num-kv-blocks", "7", "--dtype",
                              "bf16", "--no-enable-prefix-caching", "--no-enable-chunked-prefill",
                              "--scheduling-policy", "priority", "--seed", "5", "--max-logprobs", "3"])
    cfg = EngineConfig(**engine_kwargs(args))
    assert (cfg.quantization, cfg.kv_cache_memory, cfg.num_kv_blocks, cfg.dtype) == ("int4", "512MiB", 7, "bf16")
    assert (cfg.enable_prefix_caching, cfg.enable_chunked_prefill, cfg.scheduling_policy, cfg.seed,
            cfg.max_logprobs) == (False, False, "priority", 5, 3)
    assert parser.parse_args(["x", "--enable-prefix-caching"]).enable_prefix_caching is True
    for bad in (["--kv-cache-memory", "lots"], ["--dtype", "int3"], ["--scheduling-policy", "lifo"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["x", *bad])
    with pytest.raises(ValueError, match="scheduling_policy must be one of"):
        EngineConfig(scheduling_policy="lifo")
    with pytest.raises(ValueError, match="Cannot parse a memory size"):
        EngineConfig(swap_space="lots")


def test_yaml_config_sets_engine_fields_and_flags_win(tmp_path):
    parser = _engine_parsers()["serve"]
    path = tmp_path / "serve.yaml"
    path.write_text("max-num-seqs: 8\nenable-prefix-caching: false\nkv-cache-memory: 1GiB\nscheduling-policy: "
                    "priority\nmax-body-bytes: 1MiB\nmodel: {small: smollm2-135m}\napi-key: k1\n")
    args = parser.parse_args(["--max-num-seqs", "4"])
    apply_config(args, parser, str(path))
    kwargs = engine_kwargs(args)
    assert (kwargs["max_num_seqs"], kwargs["enable_prefix_caching"], kwargs["kv_cache_memory"]) == (4, False, "1GiB")
    assert kwargs["scheduling_policy"] == "priority" and args.model == ["small=smollm2-135m"]
    assert args.api_key == ["k1"]  # a repeatable option takes one value too
    assert ServeConfig.from_args(args, engine_kwargs).server.max_body_bytes == 2**20  # parsed as the flag parses it
    path.write_text("no-such-option: 1\n")
    with pytest.raises(ValueError, match="unknown option"):
        apply_config(parser.parse_args([]), parser, str(path))


def test_no_enable_prefix_caching_reaches_the_engine(tiny_model_dir):
    args = _engine_parsers()["generate"].parse_args(["x", "--model", str(tiny_model_dir), "--dtype", "float32",
                                                     "--num-kv-blocks", "16", "--no-enable-prefix-caching"])
    eng = LLMEngine.from_args(**engine_kwargs(args))
    assert eng.config.enable_prefix_caching is False and eng.block_manager.enable_prefix_caching is False
    eng = LLMEngine.from_args(**engine_kwargs(_engine_parsers()["generate"].parse_args(
        ["x", "--model", str(tiny_model_dir), "--dtype", "float32", "--num-kv-blocks", "16"])))
    assert eng.block_manager.enable_prefix_caching is True


def _sample(tiny_model_dir, seed, params):
    """Tokens of the requests (one prompt) on a fresh engine seeded `seed`."""
    eng = LLMEngine.from_args(str(tiny_model_dir), dtype="float32", num_kv_blocks=64, seed=seed)
    for i, p in enumerate(params):
        eng.add_request(str(i), [1, 2, 3, 4], p)
    done = Steps(eng).run()
    return [done[str(i)].outputs[0].token_ids for i in range(len(params))]


def test_engine_seed_makes_unseeded_requests_reproducible(tiny_model_dir):
    """vLLM's global seed: requests without a seed draw from the engine's generator, so two engines with the same
    seed sample the same tokens for the same requests; another seed samples others; a request's own seed wins."""
    free = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    params = [free, free, SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=7)]
    torch.manual_seed(0)
    first = _sample(tiny_model_dir, 3, params)
    torch.manual_seed(1)  # the global RNG plays no part
    assert _sample(tiny_model_dir, 3, params) == first
    assert first[0] != first[1]  # one generator for the engine, not a copy per request
    other = _sample(tiny_model_dir, 4, params)
    assert other[:2] != first[:2] and other[2] == first[2]


def test_sampler_seed_draws_unseeded_rows_from_its_generator():
    logits = torch.randn(3, 50)
    rows = [SamplingRow(SamplingParams(temperature=1.0), [1], []) for _ in range(3)]
    draws = [Sampler(seed=11)(logits, rows).token_ids for _ in range(2)]
    assert draws[0] == draws[1]
    s = Sampler(seed=11)
    assert [s(logits, rows).token_ids for _ in range(4)] != [draws[0]] * 4  # the generator advances


@pytest.mark.parametrize("env, expected", [({}, "20000"), ({"GOMP_SPINCOUNT": "7"}, "7"),
                                           ({"OMP_WAIT_POLICY": "passive"}, "None")])
def test_openmp_spin_wait_default_is_set_before_torch_loads(env, expected):
    """`import pagedlm` shortens libgomp's spin-wait (GOMP_SPINCOUNT) unless the user chose one (or a wait policy),
    and does it before torch (which loads libgomp and reads it once) is imported."""
    import os
    import subprocess
    import sys

    code = "import os; import pagedlm; print(os.environ.get('GOMP_SPINCOUNT'))"
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                         check=True, timeout=120).stdout.split()
    assert out[0] == expected
    code = "import os; import pagedlm.outputs, torch; print(os.environ.get('GOMP_SPINCOUNT'))"
    out = subprocess.run([sys.executable, "-c", code], env=base, capture_output=True, text=True, check=True,
                         timeout=120).stdout.split()
    assert out == ["20000"]  # any pagedlm import sets it first: the package's __init__ runs before its modules


def test_chat_holds_a_conversation(tiny_2k_model_dir, monkeypatch, capsys):
    """`pagedlm chat MODEL`: each line read is a user turn of one conversation, answered as LLM.chat answers that
    conversation (greedy); /clear starts over, /bye ends; piped input reads line by line; three double quotes open
    a turn of several lines."""
    import io

    from pagedlm import LLM

    llm = LLM(str(tiny_2k_model_dir), dtype="float32", num_kv_blocks=256)

    def answer(messages):
        out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)[0].outputs[0]
        assert len(out.token_ids) == 6  # a whole answer (this model does not stop early)
        return out.text

    first = answer([{"role": "user", "content": "Hi"}])
    second = answer([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first},
                     {"role": "user", "content": "How are you?"}])
    several = answer([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first},
                      {"role": "user", "content": "one\ntwo"}])
    monkeypatch.setattr("sys.stdin", io.StringIO('Hi\nHow are you?\n/clear\nHi\n"""one\ntwo"""\n/bye\nnever read\n'))
    flags = ["--dtype", "float32", "--num-kv-blocks", "256", "--temperature", "0", "--max-tokens", "6"]
    assert main(["chat", str(tiny_2k_model_dir), *flags]) == 0
    lines = f"{first}\n{second}\n(the conversation is cleared)\n{first}\n{several}\n"  # three double quotes: one turn
    assert capsys.readouterr().out == lines
