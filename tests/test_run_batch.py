"""`pagedlm run-batch`: a file in OpenAI's batch format answered through the server's own app in process, on a tiny
random model: the answers the HTTP server gives, in the input's order, every line that is no request named in the
output, a bounded number of requests in flight, a full queue retried, and the command line end to end."""
from __future__ import annotations

import asyncio
import io
import json

import pytest
from server_utils import InProcessServer

from pagedlm.cli import main
from pagedlm.config import LoopConfig
from pagedlm.engine.async_engine import AsyncLLMEngine
from pagedlm.engine.llm_engine import LLMEngine
from pagedlm.server.api import build_app
from pagedlm.server.run_batch import run_batch

CHAT = {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8, "temperature": 0}
COMPLETION = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def engine(tiny_2k_model_dir):
    engine = AsyncLLMEngine(LLMEngine.from_args(str(tiny_2k_model_dir), dtype="float32", num_kv_blocks=512,
                                                speculative_config="off"),
                            LoopConfig.offline(log_interval=0))
    yield engine
    engine.shutdown()


def line(custom_id, url, body, **extra) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body, **extra})


def run(app, lines: list[str], **kw) -> tuple[list[dict], object]:
    out = io.StringIO()
    summary = asyncio.run(run_batch(app, io.StringIO("\n".join(lines) + "\n"), out, **kw))
    return [json.loads(x) for x in out.getvalue().splitlines()], summary


def test_a_batch_gets_the_servers_answers_in_order(engine):
    srv = InProcessServer(build_app({"tiny": engine}))
    try:
        chat = srv.post("/v1/chat/completions", json={"model": "tiny", **CHAT}).json()
        completion = srv.post("/v1/completions", json={"model": "tiny", **COMPLETION}).json()
    finally:
        srv.stop()
    lines = [line("c1", "/v1/chat/completions", {"model": "tiny", **CHAT}),
             line("p1", "/v1/completions", COMPLETION),  # no model: the first served
             "not json",
             line("c1", "/v1/completions", COMPLETION),
             "",  # blank lines are skipped
             line("bad", "/v1/completions", {**COMPLETION, "max_tokens": -1}),
             line("models", "/v1/models", {}),
             line("stream", "/v1/chat/completions", {**CHAT, "stream": True}),
             line("get", "/v1/completions", COMPLETION, method="GET"),
             json.dumps({"url": "/v1/completions", "body": COMPLETION}),
             line("nope", "/v1/completions", {**COMPLETION, "model": "nope"}),
             line("r1", "/v1/responses", {"input": "Hello", "max_output_tokens": 4})]
    records, summary = run(build_app({"tiny": engine}), lines)
    assert [r["custom_id"] for r in records] == ["c1", "p1", None, "c1", "bad", "models", "stream", "get", None,
                                                 "nope", "r1"]
    assert len({r["id"] for r in records}) == len(records) and all(r["id"].startswith("batch_req_") for r in records)
    ok = [records[i] for i in (0, 1, 10)]
    assert all(r["response"]["status_code"] == 200 and r["error"] is None for r in ok)
    assert ok[0]["response"]["body"]["choices"][0]["message"] == chat["choices"][0]["message"]
    assert ok[0]["response"]["request_id"] == ok[0]["response"]["body"]["id"]
    assert ok[1]["response"]["body"]["choices"][0]["text"] == completion["choices"][0]["text"]
    assert ok[1]["response"]["body"]["model"] == ok[2]["response"]["body"]["model"] == "tiny"
    lines_named = {i: r["error"] for i, r in enumerate(records) if r["response"] is None}
    assert {i: (e["code"], e["line"]) for i, e in lines_named.items()} == {
        2: ("invalid_request", 3), 3: ("duplicate_custom_id", 4), 5: ("unsupported_url", 7),
        6: ("invalid_request", 8), 7: ("invalid_request", 9), 8: ("invalid_request", 10)}
    assert "stream" in lines_named[6]["message"] and "POST" in lines_named[7]["message"]
    bad, nope = records[4], records[9]  # refused by the API: its status and error body, and `error`
    assert bad["response"]["status_code"] == 400 and bad["response"]["body"]["error"]["param"] == "max_tokens"
    assert bad["error"]["message"] == bad["response"]["body"]["error"]["message"]
    assert nope["response"]["status_code"] == 404 and nope["error"]["code"] == "model_not_found"
    assert (summary.requests, summary.succeeded, summary.failed) == (11, 3, 8)
    assert summary.completion_tokens == 8 + 6 + 4 and summary.prompt_tokens > 0
    assert engine.engine.block_manager.num_free_blocks == engine.engine.block_manager.num_total_blocks


def test_requests_in_flight_stay_within_the_window_and_outputs_keep_the_input_order(engine):
    app = build_app({"tiny": engine})
    live, most = 0, 0

    async def counting(scope, receive, send):
        nonlocal live, most
        live += 1
        most = max(most, live)
        try:
            await app(scope, receive, send)
        finally:
            live -= 1

    lengths = [40, 1, 2, 1, 30, 1, 1, 3, 1, 1]  # a long first answer: the others finish first and wait for it
    lines = [line(f"r{i}", "/v1/completions", {**COMPLETION, "max_tokens": n, "ignore_eos": True})
             for i, n in enumerate(lengths)]
    records, summary = run(counting, lines, window=3)
    assert [r["custom_id"] for r in records] == [f"r{i}" for i in range(len(lengths))]
    assert [r["response"]["body"]["usage"]["completion_tokens"] for r in records] == lengths
    assert most == 3 and summary.succeeded == len(lengths)


def test_a_full_queue_is_retried_until_there_is_room(tiny_2k_model_dir):
    """One sequence at a time and one waiting: the batch's other requests get 503 and are sent again."""
    engine = AsyncLLMEngine(LLMEngine.from_args(str(tiny_2k_model_dir), dtype="float32", num_kv_blocks=64,
                                                max_num_seqs=1, speculative_config="off"),
                            LoopConfig(max_waiting=1, log_interval=0))
    app = build_app({"tiny": engine})
    statuses = []

    async def recording(scope, receive, send):
        async def sending(message):
            if message["type"] == "http.response.start":
                statuses.append(message["status"])
            await send(message)
        await app(scope, receive, sending)

    try:
        records, summary = run(recording, [line(f"r{i}", "/v1/completions", COMPLETION) for i in range(6)])
    finally:
        engine.shutdown()
    assert statuses.count(503) >= 1 and statuses.count(200) == 6
    assert summary.succeeded == 6 and all(r["response"]["status_code"] == 200 for r in records)


def test_a_line_over_the_limit_is_named_and_skipped(engine):
    long = line("long", "/v1/completions", {**COMPLETION, "prompt": "x " * 400})
    records, summary = run(build_app({"tiny": engine}, max_body_bytes=300),
                           [long, line("ok", "/v1/completions", COMPLETION),
                            line("big", "/v1/completions", {**COMPLETION, "prompt": "y " * 150})],
                           max_line_chars=500)
    assert records[0]["custom_id"] is None and records[0]["error"]["code"] == "line_too_long"
    assert records[1]["response"]["status_code"] == 200
    assert records[2]["response"]["status_code"] == 413  # the server's own body limit
    assert summary.failed == 2


def test_the_command_line(tiny_2k_model_dir, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PAGEDLM_API_KEY", "k")  # the server's key does not lock the batch out
    src, dst = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join([line("a", "/v1/chat/completions", CHAT), "{", line("b", "/v1/completions", COMPLETION)]))
    flags = ["--dtype", "float32", "--num-kv-blocks", "64", "--speculative-config", "off"]
    assert main(["run-batch", "-i", str(src), "-o", str(dst), str(tiny_2k_model_dir), *flags]) == 0
    records = [json.loads(x) for x in dst.read_text().splitlines()]
    assert [r["custom_id"] for r in records] == ["a", None, "b"]
    assert [(r["response"] or {}).get("status_code") for r in records] == [200, None, 200]
    assert records[2]["response"]["body"]["model"] == str(tiny_2k_model_dir)
    capsys.readouterr()
    piped = (line("x", "/v1/completions", COMPLETION) + "\n").encode() + b'{"custom_id": "\xff\xfe"}\n'
    monkeypatch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(piped)))  # bytes that are no UTF-8 included
    assert main(["run-batch", "-i", "-", "-o", "-", str(tiny_2k_model_dir), *flags]) == 0
    piped_out = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert piped_out[0]["response"]["status_code"] == 200 and piped_out[1]["custom_id"] == "\ufffd\ufffd"
    assert main(["run-batch", "-i", str(src), "-o", str(src), str(tiny_2k_model_dir)]) == 2
    assert main(["run-batch", "-i", str(tmp_path / "none.jsonl"), "-o", str(dst), str(tiny_2k_model_dir)]) == 2
    err = capsys.readouterr().err
    assert "must not be the input file" in err and "no such file" in err
