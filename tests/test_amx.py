"""The AMX (TMUL) paths of the quantized kernels (csrc/amx_x16.h): on a CPU with AMX-INT8 every x16 layout they cover
(int4 with fp16 scales and minimums, GGUF Q4_0 / Q4_1, int8, GGUF Q8_0) gives the VNNI kernel's bits at any number
of rows and shape, so a row's result never depends on the rows batched with it. Q4_K's products, over activations
with one scale per 256 values, have no AMX path. Skipped elsewhere."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_gguf_formats import random_blocks

from pagedlm.hub.blocks import RawBlocks
from pagedlm.model import quant

ROWS = (1, 2, 3, 4, 15, 16, 17, 33, 64, 100)


@pytest.fixture
def lib():
    lib = quant.load_quant_kernel()
    if lib is None or not quant.kernel.amx_native():
        pytest.skip("no AMX-INT8 here (or the tile state was refused): the VNNI kernels run")
    yield lib
    lib.pagedlm_amx_enable(1)


def _layers(n: int, k: int) -> dict[str, quant.QuantLinear]:
    g = torch.Generator().manual_seed(n * 1000 + k)
    w = torch.randn(n, k, generator=g) * 0.05
    layers = {"int4": quant.Int4Linear(w, 32, x16=True), "int8": quant.Int8Linear(w, x16=True)}
    if k % 64 == 0:
        layers["int4-g64"] = quant.Int4Linear(w, 64, x16=True)
    for kind in ("Q4_0", "Q4_1", "Q8_0"):
        raw = RawBlocks.from_gguf(random_blocks(kind, n, k, 3), kind, k)
        layers[kind] = quant.GGUFLinear(raw) if kind == "Q8_0" else quant.Int4Linear(raw, 32, x16=True)
    for layer in layers.values():
        layer.kernel_max_rows = 1 << 20
    return layers


@pytest.mark.parametrize("shape", [(48, 96), (64, 544), (32, 768)])
def test_amx_products_are_the_vnni_kernels_bits(lib, shape):
    """Each layout at 1-100 rows (groups of 16 rows, full and partial; an odd number of blocks; 3 tiles): bit-identical
    to the VNNI kernel, and Q8(x) @ W^T within fp32 rounding of the dequantize-then-matmul reference."""
    n, k = shape
    g = torch.Generator().manual_seed(7)
    for name, layer in _layers(n, k).items():
        assert getattr(layer, "x16", True), name
        w = layer.dequantize().double()
        for m in ROWS:
            x = torch.randn(m, k, generator=g)
            before = lib.pagedlm_amx_products()
            lib.pagedlm_amx_enable(2)  # AMX at every row count
            amx = layer(x)
            assert lib.pagedlm_amx_products() == before + 1, (name, m)
            lib.pagedlm_amx_enable(0)
            vnni = layer(x)
            assert lib.pagedlm_amx_products() == before + 1
            assert torch.equal(amx, vnni), (name, m, (amx - vnni).abs().max())
            ref = F.linear(layer.dense_input(x).double(), w)
            torch.testing.assert_close(amx.double(), ref, rtol=1e-5, atol=1e-5)


def test_rows_in_a_batch_match_the_same_rows_alone(lib):
    """A 64-row product (AMX by default) gives each row the bits it gets alone (1 row: the VNNI kernel)."""
    lib.pagedlm_amx_enable(1)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 256, generator=g)
    for name, layer in _layers(48, 256).items():
        before = lib.pagedlm_amx_products()
        full = layer(x)
        assert lib.pagedlm_amx_products() == before + 1, name  # the batch ran on AMX tiles
        for i in (0, 17, 63):
            assert torch.equal(layer(x[i:i + 1]), full[i:i + 1]), (name, i)
        assert lib.pagedlm_amx_products() == before + 1, name  # single rows did not


def test_the_plan_says_big_steps_run_on_amx_tiles(lib):
    from pagedlm.config import EngineConfig
    from pagedlm.model.plan import plan_execution

    for method in ("int4", "int8"):
        plan = plan_execution(EngineConfig(quantization=method, kernel_max_rows=8), None)
        assert "AMX tiles" in plan.describe(), method
    assert "AMX" not in plan_execution(EngineConfig(kernel_max_rows=8), None).describe()  # unquantized


def test_q4_k_runs_the_vnni_kernels(lib):
    """Q4_K's products (one activation scale per 256 values) stay on the VNNI kernels: no AMX pass at any size."""
    lib.pagedlm_amx_enable(2)
    layer = quant.Int4Linear(RawBlocks.from_gguf(random_blocks("Q4_K", 48, 512, 3), "Q4_K", 512), 32, x16=True)
    layer.kernel_max_rows = 1 << 20
    before = lib.pagedlm_amx_products()
    layer(torch.randn(64, 512, generator=torch.Generator().manual_seed(6)))
    assert lib.pagedlm_amx_products() == before
