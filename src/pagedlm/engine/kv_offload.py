"""The prefix cache's disk tier in the engine (kvcache/disk_tier.py has the files): which blocks are written, when
a request waits for its prefix to load, and how loaded blocks become ordinary prefix-cache blocks.

- Write-through: after each forward pass, the blocks it filled (registered in the prefix cache) are copied out of
  the KV cache and queued for writing, once per chain hash. Writing when blocks are computed, rather than when they
  are evicted from memory, keeps them across a crash or a kill (nothing resident is lost) and lets other engines
  find them at once; it costs a copy per new full block on the engine thread, while the writing runs behind.
  A run the write budget (`--kv-disk-write-share`) refuses is neither copied nor written: it stays in memory only.
- Loading: a waiting request whose prefix misses in memory but whose next blocks are on disk is set aside
  (`defer`: the scheduler's `loading` list) while the loader thread reads them; other requests keep stepping. When
  the read is done (`ready`) the blocks are written into fresh KV blocks, registered in the prefix cache and freed
  (cached, as an evicted prefix would be), and the request goes back to the head of the waiting queue, where
  `find_cached_prefix` finds them: it continues as a normal prefix hit. A request is looked up once until it
  runs; a failed or partial load leaves the rest to be computed.
- Worth it or not used: a load is skipped when its predicted time (blocks x record size / the measured read rate)
  exceeds the predicted prefill time of those tokens (the measured prefill rate of this engine's steps).
"""
from __future__ import annotations

import hashlib
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch

from pagedlm.config import EngineConfig, ModelConfig, parse_bytes
from pagedlm.engine.sequence import Request
from pagedlm.kvcache.block_manager import BlockManager
from pagedlm.kvcache.disk_tier import DiskTier, LoadResult
from pagedlm.kvcache.kv_cache import KVCache, KVCacheSpec
from pagedlm.model.plan import ExecutionPlan

_RATE_EMA = 0.3  # weight of the newest measurement in the read and prefill rates
_MIN_PREFILL_TOKENS = 64  # steps with fewer tokens say little about the prefill rate
_MAX_RUN_BYTES = 64 << 20  # the largest run file


def model_identity(path: Path, model_config: ModelConfig, plan: ExecutionPlan, spec: KVCacheSpec) -> dict:
    """What KV blocks depend on: the checkpoint (names, sizes and mtimes of its files), the architecture, how the
    weights run, and the KV cache's dtype and layout."""
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    h = hashlib.blake2b(digest_size=16)
    for f in files:
        st = f.stat()
        h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    weights = (plan.dtype, plan.quantization, plan.group_size, plan.fallback, plan.dense_dtype, plan.native_types)
    return {"model": f"{path.name}:{h.hexdigest()}",
            "architecture": hashlib.blake2b(repr(model_config).encode(), digest_size=16).hexdigest(),
            "weights": repr(weights), "kv_dtype": str(spec.dtype),
            "layout": [spec.layers_per_block, spec.num_kv_heads, spec.entry_dim, spec.block_size]}


@dataclass
class _Load:
    request: Request
    chain: list[bytes]
    tokens: list[list[int]]
    first: int
    future: Future


class DiskOffload:
    """Connects a DiskTier to the block manager, the KV cache and the scheduler (its `kv_loader`)."""

    def __init__(self, tier: DiskTier, block_manager: BlockManager, kv_cache: KVCache) -> None:
        self.tier = tier
        self.bm = block_manager
        self.kv = kv_cache
        spec = kv_cache.spec
        self.record_shape = (spec.layers_per_block, 2, spec.block_size, spec.num_kv_heads, spec.entry_dim)
        self.loads: dict[str, _Load] = {}
        self.tried: dict[str, Request] = {}  # requests looked up on disk already, until they run or end
        self.read_rate: float | None = None  # bytes/s
        self.prefill_rate: float | None = None  # tokens/s

    @classmethod
    def create(cls, config: EngineConfig, path: Path, model_config: ModelConfig, plan: ExecutionPlan,
               block_manager: BlockManager, kv_cache: KVCache) -> DiskOffload | None:
        """The tier of `--kv-cache-dir`, or None when there is none (or prefix caching is off)."""
        if config.kv_cache_dir is None or not block_manager.enable_prefix_caching:
            return None
        spec = kv_cache.spec
        tier = DiskTier(config.kv_cache_dir, parse_bytes(config.kv_disk_budget),
                        model_identity(path, model_config, plan, spec), spec.bytes_per_block,
                        write_share=config.kv_disk_write_share)
        return cls(tier, block_manager, kv_cache)

    # --- writing -----------------------------------------------------------------------------------------
    def after_forward(self, scheduled) -> None:
        """Queue the blocks the step's forward pass filled (`scheduled`: its ScheduledSeqs) for writing."""
        bs = self.bm.block_size
        for s in scheduled:
            hashes = self.bm.seq_hashes.get(s.seq.seq_id, [])
            table = self.bm.get_block_table(s.seq)
            run: list[int] = []
            for i in range(s.start // bs, min((s.start + s.num_new_tokens) // bs, len(hashes), len(table))):
                if self.bm.gpu.block_hash[table[i]] == hashes[i] and hashes[i] not in self.tier.known:
                    if run and run[-1] != i - 1:
                        self._submit(s.seq, run, hashes, table)
                        run = []
                    run.append(i)
            if run:
                self._submit(s.seq, run, hashes, table)

    def _submit(self, seq, idx: list[int], hashes: list[bytes], table: list[int]) -> None:
        most = max(1, _MAX_RUN_BYTES // self.tier.record_bytes)
        if len(idx) > most:  # files of bounded size, each a small share of the write queue
            for i in range(0, len(idx), most):
                self._submit(seq, idx[i:i + most], hashes, table)
            return
        if (charged := self.tier.admit(len(idx))) is None:
            return
        t0 = time.perf_counter()
        bs = self.bm.block_size
        blocks = torch.tensor([table[i] for i in idx], dtype=torch.long, device=self.kv.gpu.device)
        records = self.kv.gpu[:, :, blocks].permute(2, 0, 1, 3, 4, 5).contiguous().cpu()
        records = records.view(torch.uint8).reshape(len(idx), -1)
        self.tier.submit(idx[0], [hashes[i] for i in idx], [seq.token_slice(i * bs, (i + 1) * bs) for i in idx],
                         records, charged, time.perf_counter() - t0)

    def observe_step(self, num_tokens: int, seconds: float) -> None:
        """A forward pass of `num_tokens` tokens took `seconds`: the prefill rate the loads compete with."""
        if num_tokens >= _MIN_PREFILL_TOKENS and seconds > 0:
            self.prefill_rate = _ema(self.prefill_rate, num_tokens / seconds)

    # --- loading -----------------------------------------------------------------------------------------
    def defer(self, req: Request, hits: dict[int, list[int]]) -> bool:
        """Called for a waiting request with its prefix cache hits in memory (seq id -> blocks): True when the
        blocks after them are being loaded from disk (it waits in the scheduler's `loading` list until `ready`)."""
        if req.request_id in self.tried or len(req.live_seqs) != 1 or req.wants_prompt_logprobs:
            return False
        seq = req.live_seqs[0]
        bs = self.bm.block_size
        n = (seq.num_tokens - 1) // bs
        first = len(hits.get(seq.seq_id, []))
        if first >= n:
            return False
        chain = self.bm.seq_hashes.get(seq.seq_id, [])[:n]
        if len(chain) < n:
            return False
        self.tried[req.request_id] = req  # one lookup per admission, however many steps it waits
        stats = self.tier.stats
        stats.lookups += 1
        avail = min(self.tier.probe(chain, first), self.bm.num_free_blocks - self.bm.watermark_blocks)
        if avail <= 0:
            stats.misses += 1
            return False
        if self.read_rate and self.prefill_rate and \
                avail * self.tier.record_bytes / self.read_rate > avail * bs / self.prefill_rate:
            stats.skipped += 1
            return False
        tokens = [seq.token_slice(i * bs, (i + 1) * bs) for i in range(n)]
        self.loads[req.request_id] = _Load(req, chain, tokens, first,
                                           self.tier.start_load(chain, tokens, first, avail))
        return True

    def ready(self) -> list[Request]:
        """The requests whose loads finished, their blocks now in the prefix cache, in the order they started."""
        self.tried = {rid: r for rid, r in self.tried.items()
                      if not r.finished and not any(s.num_computed_tokens for s in r.live_seqs)}
        done = [rid for rid, ld in self.loads.items() if ld.future.done()]
        out = []
        for rid in done:
            ld = self.loads.pop(rid)
            try:
                result = ld.future.result()
            except Exception:  # an unexpected read error: the blocks are computed instead
                result = None
            if ld.request.finished:
                continue
            if result is not None and result.count:
                self._insert(ld, result)
                self.read_rate = _ema(self.read_rate, result.nbytes / max(result.seconds, 1e-6))
            out.append(ld.request)
        return out

    def wait(self, timeout: float) -> None:
        """Block until a load finishes, or `timeout` passes (for a step that has nothing else to run)."""
        for ld in self.loads.values():
            try:
                ld.future.exception(timeout)
            except Exception:
                pass
            return

    def _insert(self, ld: _Load, result: LoadResult) -> None:
        """Put the loaded blocks into free KV blocks and the prefix cache (ref count 0: cached, evictable)."""
        pool = self.bm.gpu
        held = []  # the prefix before the loaded blocks, held while blocks are allocated (which could evict it)
        for i in range(ld.first):
            block = pool.lookup(ld.chain[i], ld.tokens[i])
            if block is None:
                break
            pool.incref(block)
            held.append(block)
        try:
            self._fill(ld, result)
        finally:
            for block in reversed(held):
                pool.decref(block)

    def _fill(self, ld: _Load, result: LoadResult) -> None:
        pool = self.bm.gpu
        room = self.bm.num_free_blocks - self.bm.watermark_blocks
        new: list[tuple[int, int]] = []  # (record index, block)
        for k in range(result.count):
            i = ld.first + k
            if pool.lookup(ld.chain[i], ld.tokens[i]) is not None:
                continue
            if len(new) >= room:
                break
            new.append((k, pool.allocate()))
        if not new:
            return
        records = result.records[[k for k, _ in new]].view(self.kv.gpu.dtype)
        records = records.reshape(len(new), *self.record_shape).permute(1, 2, 0, 3, 4, 5)
        blocks = torch.tensor([b for _, b in new], dtype=torch.long, device=self.kv.gpu.device)
        self.kv.gpu[:, :, blocks] = records.to(self.kv.gpu.device)
        for k, block in new:
            pool.register(block, ld.chain[ld.first + k], ld.tokens[ld.first + k])
        for _, block in reversed(new):  # the end of the chain is evicted first
            pool.decref(block)

    def close(self) -> None:
        self.tier.close()


def _ema(old: float | None, new: float) -> float:
    return new if old is None else (1 - _RATE_EMA) * old + _RATE_EMA * new


