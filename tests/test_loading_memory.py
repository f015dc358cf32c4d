"""Loading at scale: a quantized checkpoint streams into its final format, so the process grows by about the file's
size plus the KV cache (never by a full-precision copy of the model), the file's pages are not kept mapped beside
the converted weights, and big steps of a model too large for a dense copy dequantize per call."""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch

from pagedlm import cbuild
from pagedlm.config import EngineConfig
from pagedlm.hub.gguf_file import read_gguf
from pagedlm.model import plan as plan_module
from pagedlm.model import quant

Q = gguf.GGMLQuantizationType


def _blocks(rng: np.random.Generator, rows: int, cols: int, qtype: Q) -> np.ndarray:
    """Random blocks of `qtype` (a finite fp16 scale each, random codes): speed and memory do not depend on values."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    raw[..., 0:2] = np.frombuffer(np.float16(0.002).tobytes(), np.uint8)
    return raw.reshape(rows, -1)


def write_random_llama(out: Path, tokenizer_from: Path, hidden: int, layers: int, heads: int, kv_heads: int,
                       ffn: int, qtype: Q = Q.Q4_0) -> Path:
    """A random-weight LLaMA GGUF (linear weights `qtype`, Q8_0 tied embedding) with the tokenizer of another."""
    src = read_gguf(tokenizer_from).fields
    vocab = len(src["tokenizer.ggml.tokens"])
    w = gguf.GGUFWriter(str(out), "llama")
    for add, value in ((w.add_context_length, 2048), (w.add_embedding_length, hidden), (w.add_block_count, layers),
                       (w.add_feed_forward_length, ffn), (w.add_head_count, heads), (w.add_head_count_kv, kv_heads),
                       (w.add_rope_dimension_count, hidden // heads), (w.add_layer_norm_rms_eps, 1e-5),
                       (w.add_vocab_size, vocab), (w.add_tokenizer_model, src["tokenizer.ggml.model"]),
                       (w.add_token_list, src["tokenizer.ggml.tokens"]),
                       (w.add_token_types, src["tokenizer.ggml.token_type"]),
                       (w.add_token_merges, src["tokenizer.ggml.merges"]),
                       (w.add_eos_token_id, src["tokenizer.ggml.eos_token_id"])):
        add(value)
    rng = np.random.default_rng(0)
    dim = hidden // heads
    w.add_tensor("token_embd.weight", _blocks(rng, vocab, hidden, Q.Q8_0), raw_dtype=Q.Q8_0)
    for i in range(layers):
        for name, rows, cols in (("attn_q", heads * dim, hidden), ("attn_k", kv_heads * dim, hidden),
                                 ("attn_v", kv_heads * dim, hidden), ("attn_output", hidden, heads * dim),
                                 ("ffn_gate", ffn, hidden), ("ffn_up", ffn, hidden), ("ffn_down", hidden, ffn)):
            w.add_tensor(f"blk.{i}.{name}.weight", _blocks(rng, rows, cols, qtype), raw_dtype=qtype)
        for name in ("attn_norm", "ffn_norm"):
            w.add_tensor(f"blk.{i}.{name}.weight", np.ones(hidden, dtype=np.float32))
    w.add_tensor("output_norm.weight", np.ones(hidden, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def random_300m(smollm2_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """~330M parameters (hidden 2048, 7 layers, FFN 5632, SmolLM2's 49k vocabulary): a 200 MB Q4_0 file, big
    enough that a full-precision copy (1.3 GB) or a second copy of the weights would break the bound below."""
    from pagedlm.hub.tokenizer import load_tokenizer

    path = write_random_llama(tmp_path_factory.mktemp("scale") / "random-300m.gguf", smollm2_path, 2048, 7, 32, 4,
                              5632)
    load_tokenizer(path)  # its converted vocabulary cached beside it, as after any first start
    return path


_MEASURE = textwrap.dedent("""
    import json, sys
    import torch
    from pathlib import Path
    from pagedlm.engine.llm_engine import LLMEngine
    from pagedlm.hub.tokenizer import load_tokenizer
    from pagedlm.model import load_model

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    def peak():  # this process's high-water mark (ru_maxrss would count the forking parent's too)
        return status("VmHWM")
    args = json.loads(sys.argv[1])
    if sys.argv[2] == "model":  # the weights alone, after the tokenizer (a fixed cost, whatever the model's size)
        load_tokenizer(Path(args["model"]))
        before = status("VmRSS")
        model, _ = load_model(Path(args["model"]), torch.float32, torch.device("cpu"), "int4", 32, None, 1 << 16)
        print(json.dumps({"growth": peak() - before, "file_rss": status("RssFile")}))
    else:
        before = status("VmRSS")
        engine = LLMEngine.from_args(**args)
        print(json.dumps({"growth": peak() - before, "kv": engine.memory_report.kv_cache_bytes,
                          "weights": engine.runner.weight_bytes(), "plan": engine.plan.describe()}))
""")
RUNTIME_ALLOWANCE = 128 * 2**20  # the tokenizer's tables and the kernels' libraries: the same for any model size


def _measure(path: Path, what: str) -> dict:
    args = {"model": str(path), "kv_cache_memory": "256MiB", "kernel_max_rows": 1 << 16}
    out = subprocess.run([sys.executable, "-c", _MEASURE, json.dumps(args), what], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_loading_grows_by_the_file_and_the_kv_cache(random_300m: Path) -> None:
    """In a fresh process, the default plan (int4 blocks as stored): loading the weights grows the peak RSS by at
    most 1.15 x the file's size (the largest tensor's temporaries included), and the file's pages are no longer
    mapped in afterwards (their bytes are in the converted weights); a whole engine by at most (file + KV cache) x
    1.15 plus a fixed allowance for the runtime. Before streaming, the model was built in fp32 first (4 bytes per
    parameter: 1.3 GB here against a 280 MB file) and its vocabulary table dequantized whole."""
    size = random_300m.stat().st_size
    r = _measure(random_300m, "model")
    assert r["growth"] <= size * 1.15, (r["growth"], size)
    assert r["file_rss"] < size * 0.5  # not a second copy of the weights in mapped file pages
    r = _measure(random_300m, "engine")
    assert "own Q4_0 blocks" in r["plan"] and r["weights"] < size * 1.05
    assert r["growth"] <= (size + r["kv"]) * 1.15 + RUNTIME_ALLOWANCE, (r["growth"], size, r["kv"])


def test_gguf_release_unmaps_a_tensors_pages(random_300m: Path) -> None:
    reader = read_gguf(random_300m)
    t = max(reader.tensors, key=lambda t: t.data.nbytes)

    def file_rss() -> int:
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("RssFile:"))

    start = file_rss()
    checksum = int(t.data.sum())  # touches every page
    assert file_rss() - start > t.data.nbytes // 1024 // 2
    reader.release(t)
    assert file_rss() - start < t.data.nbytes // 1024 // 4
    assert int(t.data.sum()) == checksum  # still readable: the pages come back from the file


def test_per_call_dequantization_equals_the_dense_copy() -> None:
    """A model too big for a dense copy runs its big steps over each weight dequantized to bf16 per call: the same
    bf16 weights as the copy (bit for bit, the kernel's x16 path), and the same products."""
    torch.manual_seed(0)
    layer = quant.Int4Linear(torch.randn(64, 256) * 0.05, 32, x16=True)
    calls = []
    lib = quant.load_quant_kernel()
    if lib is None:
        pytest.skip("no compiler for the kernel")
    real = lib.pagedlm_dequant_int4_x16_bf16
    lib.pagedlm_dequant_int4_x16_bf16 = lambda *a: calls.append(a) or real(*a)
    try:
        w = layer.dequantize_to(torch.bfloat16)
    finally:
        lib.pagedlm_dequant_int4_x16_bf16 = real
    assert calls, "the kernel's bf16 dequantization did not run"
    assert torch.equal(w, layer.dequantize().to(torch.bfloat16))
    x = torch.randn(40, 256)
    layer.kernel_max_rows = 8
    layer.set_dense(torch.bfloat16, copy=False)
    assert layer.dense is None and layer.per_call_dtype == torch.bfloat16
    per_call = layer(x)
    layer.set_dense(torch.bfloat16, copy=True)
    assert layer.dense is not None
    torch.testing.assert_close(per_call, layer(x), rtol=1e-2, atol=1e-3)
    expected = torch.nn.functional.linear(x.bfloat16(), layer.dequantize().bfloat16()).float()
    assert torch.equal(per_call, expected)
    big = quant.Int4Linear(torch.randn(2 * quant.Int4Linear.PER_CALL_ROWS + 32, 256) * 0.05, 32, x16=True)
    big.kernel_max_rows = 0
    big.set_dense(torch.bfloat16, copy=False)  # by slices of PER_CALL_ROWS output rows, the last one shorter
    torch.testing.assert_close(big(x), torch.nn.functional.linear(x.bfloat16(), big.dequantize().bfloat16()).float(),
                               rtol=1e-2, atol=1e-2)


def _skip_unless_runnable(march: str) -> None:
    from pagedlm.cpu import cpu_features

    if march in ("haswell", cbuild.EMULATED_AVX512) and not {"avx2", "fma", "f16c"} <= cpu_features().flags:
        pytest.skip("this CPU cannot run an AVX2 build")
    if march == cbuild.EMULATED_AVX512 and not cbuild.emulation_available():
        pytest.skip("no SIMDe headers (libsimde-dev) for the emulated AVX-512 build")


@pytest.mark.parametrize("march", ["x86-64", "haswell", cbuild.EMULATED_AVX512])
def test_per_call_dequantization_same_in_every_build(march: str) -> None:
    """The portable, AVX2 and (emulated) AVX-512 BF16 builds dequantize to the same bf16 weights as this CPU's
    build."""
    _skip_unless_runnable(march)
    native = quant.load_quant_kernel()
    other = quant.kernel_variant(march).load()
    if native is None or other is None:
        pytest.skip("no compiler for the kernel")
    torch.manual_seed(1)
    layer = quant.Int4Linear(torch.randn(48, 320 - 64) * 0.1, 32, x16=True)
    outs = []
    for lib in (native, other):
        w = torch.empty(48, 256, dtype=torch.bfloat16)
        assert lib.pagedlm_dequant_int4_x16_bf16(layer.qweight.data_ptr(), layer.scale.data_ptr(),
                                                 layer.mins.data_ptr(), w.data_ptr(), 256, 48, 32, 1, 2) == 0
        outs.append(w)
    assert torch.equal(outs[0], outs[1])
    assert torch.equal(outs[0], layer.dequantize().to(torch.bfloat16))


def test_plan_drops_the_dense_copy_when_it_would_not_fit(random_300m: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = EngineConfig(model=str(random_300m), kernel_max_rows=32)
    dense = plan_module.plan_execution(cfg, random_300m).dense_dtype  # bf16 where the CPU has it natively, else fp32
    need = plan_module.dense_weight_bytes(random_300m, dense)
    assert need > dense.itemsize * 330e6 * 0.9  # every matrix, in the dense dtype
    monkeypatch.setattr(plan_module, "machine_memory", lambda: int(need / plan_module.DENSE_COPY_MEMORY_FRACTION) + 1)
    assert plan_module.plan_execution(cfg, random_300m).dense_copy
    monkeypatch.setattr(plan_module, "machine_memory", lambda: int(need / plan_module.DENSE_COPY_MEMORY_FRACTION) - 1)
    p = plan_module.plan_execution(cfg, random_300m)
    assert not p.dense_copy and "dequantized per call" in p.describe()


@pytest.mark.parametrize("march", ["native", "x86-64", "haswell", cbuild.EMULATED_AVX512])
def test_gguf_blocks_convert_in_one_pass_as_the_reference(march: str, random_300m: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel writes Q4_0 / Q4_1 rows (a Q/K row permutation and a fused q/k/v included) straight into the x16
    layout, and requantizes a Q8_0 table to int8 per row: the same bytes as the reference (Int4Blocks.from_gguf ->
    rows -> cat -> to_x16; dequantize -> quantize_int8), in every build this CPU runs."""
    from pagedlm.hub.blocks import LazyRows, RawBlocks

    _skip_unless_runnable(march)
    lib = quant.load_quant_kernel() if march == "native" else quant.kernel_variant(march).load()
    if lib is None:
        pytest.skip("no compiler for the kernel")
    calls = []

    class Counting:
        def __getattr__(self, name):
            fn = getattr(lib, name)
            return (lambda *a: calls.append(name) or fn(*a)) if name.startswith("pagedlm_gguf") else fn

    rng = np.random.default_rng(3)
    for kind in ("Q4_0", "Q4_1"):
        parts = [gguf.quants.quantize(rng.standard_normal((rows, 256)).astype(np.float32) * 0.05, Q[kind])
                 for rows in (64, 32, 48)]
        raw = RawBlocks.cat([RawBlocks.from_gguf(parts[0], kind, 256).rows(rng.permutation(64)),
                           *(RawBlocks.from_gguf(p, kind, 256) for p in parts[1:])])
        ref = quant.Int4Linear(raw.blocks(), 32, x16=True)
        monkeypatch.setattr(quant.kernel, "load_quant_kernel", lambda: Counting())
        got = quant.Int4Linear(raw, 32, x16=True)
        monkeypatch.undo()
        assert all(torch.equal(getattr(got, n), getattr(ref, n)) for n in ("qweight", "scale")), kind
        assert torch.equal(got.mins, ref.mins) if kind == "Q4_1" else got.mins.numel() == 0  # Q4_0: -8 x scale
        assert all(torch.equal(a, b) for a, b in zip(got.row_layout(), ref.row_layout())), kind
    reader = read_gguf(random_300m)
    table = LazyRows(reader, next(t for t in reader.tensors if t.name == "token_embd.weight"))
    ref = quant.Int8Linear(table.materialize(), x16=True)
    monkeypatch.setattr(quant.kernel, "load_quant_kernel", lambda: Counting())
    got = quant.Int8Linear(table, x16=True)
    monkeypatch.undo()
    assert torch.equal(got.qweight, ref.qweight) and torch.equal(got.scale, ref.scale)
    assert calls.count("pagedlm_gguf_q4_to_x16") == 2 * 3 and "pagedlm_gguf_q8_0_to_int8" in calls


def test_per_call_scratch_is_per_thread() -> None:
    """Two engines (two served models) step on threads of their own: their per-call dequantizations never share a
    buffer."""
    import threading

    ptrs = {}
    both = threading.Barrier(2)  # neither thread ends (freeing its buffer for the other to get) before both have one

    def grab(name: str) -> None:
        ptrs[name] = quant.scratch(1024, torch.bfloat16).data_ptr()
        both.wait()

    threads = [threading.Thread(target=grab, args=(n,)) for n in ("a", "b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert ptrs["a"] != ptrs["b"]
    assert quant.scratch(1024, torch.bfloat16).data_ptr() == quant.scratch(512, torch.bfloat16).data_ptr()
