"""`pagedlm bench` and `pagedlm top` answer a user's mistake (a bad flag, no server, a /v1 base URL, a model or
replica the server lacks) with a one-line error and a non-zero exit, never a traceback."""
from __future__ import annotations

import json
import socket

import pytest
from server_utils import InProcessServer

from pagedlm.cli import main
from pagedlm.config import LoopConfig
from pagedlm.engine.async_engine import AsyncLLMEngine
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.server.api import build_app


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    """The tiny model as "tiny", with GET /debug/state (the memory views) on."""
    engine = AsyncLLMEngine(LLMEngine.from_args(str(tiny_model_dir), dtype="float32", num_kv_blocks=64),
                            LoopConfig.offline(log_interval=0))
    server = InProcessServer(build_app({"tiny": engine}, ui=True))
    yield server
    server.stop()
    engine.shutdown()


@pytest.fixture
def dead_url() -> str:
    """A loopback URL nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def _usage_error(capsys, argv: list[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


@pytest.mark.parametrize("argv", [
    ["throughput", "--num-prompts", "0"], ["throughput", "--batch-sizes", "1,0"], ["throughput", "--input-len", "0"],
    ["latency", "--output-len", "0"], ["latency", "--repeats", "0"], ["latency", "--prefill-lens", "8,-1"],
    ["latency", "--prefill-repeats", "0"], ["speculative", "--concurrency", "0"], ["speculative", "--k", "0"],
    ["serve", "--num-prompts", "0"], ["serve", "--request-rate", "0"], ["serve", "--vocab-size", "0"],
    ["serve", "--max-concurrency", "0"], ["serve", "--output-len", "-3"], ["kernel", "--batches", "0"],
    ["kernel", "--contexts", "16,x"], ["kernel", "--repeats", "0"],
], ids=" ".join)
def test_bench_counts_and_lengths_must_be_positive(argv, tiny_model_dir, capsys):
    model = ["--model", str(tiny_model_dir), "--dtype", "float32"] if argv[0] not in ("serve", "kernel") else []
    err = _usage_error(capsys, ["bench", *argv, *model])
    assert f"argument {argv[1]}: " in err and ("must be" in err or "not an integer" in err)


def test_bench_kernel_names_the_backends(capsys):
    assert main(["bench", "kernel", "--backend", "nosuch", "--batches", "1", "--contexts", "16"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: unknown attention backend 'nosuch'") and "cpu, reference, sdpa" in err


def test_bench_serve_without_a_server(dead_url, capsys):
    for model in ([], ["--served-model", "x"]):
        assert main(["bench", "serve", "--base-url", dead_url, "--num-prompts", "2", *model]) == 2
        assert capsys.readouterr().err.startswith(f"error: cannot reach {dead_url}: ")


def test_bench_serve_takes_a_v1_base_url(served, tmp_path, capsys):
    out = tmp_path / "serve.json"
    for base in (served.url + "/v1", served.url + "/v1/"):
        assert main(["bench", "serve", "--base-url", base, "--num-prompts", "2", "--input-len", "4",
                     "--output-len", "3", "--vocab-size", "500", "--output-json", str(out)]) == 0
        assert json.loads(out.read_text())["completed"] == 2
    assert main(["bench", "serve", "--base-url", served.url + "/v2", "--num-prompts", "2"]) == 2
    err = capsys.readouterr().err
    assert f"error: {served.url}/v2/v1/models answered HTTP 404 without a model list" in err


def test_top_exits_non_zero_without_a_server(dead_url, capsys):
    assert main(["top", dead_url, "--iterations", "1"]) == 1
    assert f"cannot reach {dead_url}" in capsys.readouterr().out


def test_top_names_the_models_and_replicas_there_are(served, capsys):
    assert main(["top", served.url, "--iterations", "1", "--model", "nosuch"]) == 2
    assert "error: the server has no model 'nosuch'; its models: tiny" in capsys.readouterr().err
    assert main(["top", served.url, "--iterations", "1", "--replica", "5"]) == 2
    assert "error: model 'tiny' has no replica '5'; its replicas: 0" in capsys.readouterr().err
    assert main(["top", served.url, "--iterations", "1", "--model", "tiny", "--replica", "0"]) == 0
    assert "pagedlm top · tiny" in capsys.readouterr().out
