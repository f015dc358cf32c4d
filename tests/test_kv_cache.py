"""The KV cache tensors on their own: layout per dtype, copy-on-write copies and the swap round trip."""
from __future__ import annotations

import pytest
import torch

from pagedlm.kvcache.kv_cache import KVCache, KVCacheSpec, make_groups

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16, torch.int8, torch.float8_e4m3fn]


def make_cache(dtype: torch.dtype, num_blocks: int = 6, num_cpu_blocks: int = 4, windows=None) -> KVCache:
    windows = windows or [None, None]
    spec = KVCacheSpec(len(windows), num_kv_heads=2, head_dim=8, block_size=4, dtype=dtype, groups=make_groups(windows))
    return KVCache(spec, num_blocks, num_cpu_blocks, CPU)


def fill_random(cache: KVCache) -> None:
    raw = cache.gpu.view(torch.uint8)  # random bytes: every dtype, quantized or not, moves as raw data
    raw.copy_(torch.randint(0, 256, raw.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(0)))


def blocks(t: torch.Tensor, ids: list[int]) -> torch.Tensor:
    return t[:, :, ids].view(torch.uint8).clone()


@pytest.mark.parametrize("dtype", DTYPES)
def test_allocation_shapes_per_dtype(dtype):
    cache = make_cache(dtype)
    quantized = dtype in (torch.int8, torch.float8_e4m3fn)
    entry = 8 + 4 if quantized else 8  # a quantized entry carries its fp32 scale
    assert cache.gpu.shape == (2, 2, 6, 4, 2, entry) and cache.cpu.shape == (2, 2, 4, 4, 2, entry)
    assert cache.gpu.dtype == cache.cpu.dtype == (torch.uint8 if quantized else dtype)
    assert not cache.gpu.any() and cache.cpu.device.type == "cpu"
    assert cache.gpu.numel() * cache.gpu.element_size() == 6 * cache.spec.bytes_per_block
    for k, v in cache.layer_caches():
        assert k.shape == v.shape == (6, 4, 2, entry) and k.dtype == v.dtype == dtype


def test_layer_caches_of_groups_share_the_block_pool():
    """Four layers, two of them sliding: two groups of two layers; layer j of each group lives in slice j."""
    cache = make_cache(torch.float32, windows=[8, None, 8, None])
    assert cache.gpu.shape[0] == 2 and [g.layers for g in cache.spec.groups] == [(0, 2), (1, 3)]
    layers = cache.layer_caches()
    assert layers[0][0].data_ptr() == layers[1][0].data_ptr() == cache.gpu[0, 0].data_ptr()
    assert layers[2][1].data_ptr() == layers[3][1].data_ptr() == cache.gpu[1, 1].data_ptr()
    layers[3][1][5].fill_(3.0)  # layer 3's V of block 5 is layer 2's V of block 5: one physical block
    assert torch.equal(layers[2][1][5], torch.full((4, 2, 8), 3.0))


@pytest.mark.parametrize("dtype", DTYPES)
def test_copy_blocks_copies_every_layer_and_nothing_else(dtype):
    cache = make_cache(dtype)
    fill_random(cache)
    before = cache.gpu.view(torch.uint8).clone()
    cache.copy_blocks([(1, 4), (2, 5)])
    after = cache.gpu.view(torch.uint8)
    assert torch.equal(after[:, :, [4, 5]], before[:, :, [1, 2]])
    assert torch.equal(after[:, :, :4], before[:, :, :4])  # the sources are untouched
    cache.copy_blocks([])  # no pairs: nothing to do
    assert torch.equal(cache.gpu.view(torch.uint8)[:, :, :4], before[:, :, :4])


@pytest.mark.parametrize("dtype", DTYPES)
def test_swap_out_and_in_round_trip_keeps_the_data(dtype):
    cache = make_cache(dtype)
    fill_random(cache)
    original = blocks(cache.gpu, [1, 3])
    cache.swap_out([(1, 0), (3, 2)])
    assert torch.equal(blocks(cache.cpu, [0, 2]), original)
    cache.gpu.view(torch.uint8)[:, :, [1, 3]] = 0  # the device blocks are reused meanwhile
    untouched = blocks(cache.gpu, [0, 2, 4])
    cache.swap_in([(0, 5), (2, 1)])  # back into other device blocks
    assert torch.equal(blocks(cache.gpu, [5, 1]), original)
    assert torch.equal(blocks(cache.gpu, [0, 2, 4]), untouched)


def test_host_cache_is_zeroed_on_demand() -> None:
    """A host KV cache of 1 GiB costs no resident memory until its blocks are written (an anonymous mapping: the
    kernel zero-fills a page when it is first touched), reads as zeros, and takes writes like any tensor."""
    def rss() -> int:
        return next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmRSS:")) * 1024

    spec = KVCacheSpec(2, 4, 64, 16, torch.bfloat16, make_groups([None, None]))
    before = rss()
    cache = KVCache(spec, spec.num_blocks_for(2**30), 0, CPU)
    assert cache.gpu.numel() * 2 >= 2**30 - spec.bytes_per_block
    assert rss() - before < 64 * 2**20
    k, v = cache.layer_caches()[1]
    assert not k[-1].any() and not v[7].any()
    k[-1].fill_(1.5)
    assert float(cache.gpu[1, 0, -1].float().sum()) == 1.5 * k[-1].numel() and not cache.gpu[0].any()
