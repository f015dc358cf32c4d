"""How many KV blocks to allocate: the budget follows from the model and is capped by the machine.

`plan_kv_budget` is the one place the engine and `pagedlm memory` size the KV cache (both through plan.py's
`plan_kv_cache`). Without `kv_cache_memory` / `num_kv_blocks`, the CPU budget is

    min(demand, cap)   demand = max_num_seqs sequences of max_model_len tokens (sliding-window groups bounded)
                       cap    = kv_cache_memory_fraction x (memory available - weights)

raised to one full max_model_len sequence where that still fits next to the weights and the overhead (so the
default max_model_len is servable whenever the machine can hold it). On CUDA the budget stays 80% of the free
device memory (after the weights), as it always was.

Why a tenth (config.DEFAULT_KV_CACHE_MEMORY_FRACTION, flag --kv-cache-memory-fraction): KVCache zero-fills its
tensors (torch.zeros), so every page of the budget is resident from start-up, whether or not a request ever
uses it (measured: 1 GiB of torch.zeros adds 1 GiB of RssAnon at once; torch.empty adds nothing until written).
Lazy pages would not help for long either: the block pool hands out the block freed longest ago (LRU, for the
prefix cache), so a serving engine walks through every block. The budget is therefore memory taken from the
machine, and the common single-user machine is a desktop or laptop where the rest belongs to other programs, the
checkpoint's page cache, activations and allocator slack. At the defaults (max_num_seqs 256) the demand is tens
of GiB for any model, so the cap decides: a tenth keeps about the 2 GiB of the former fixed default on a 24 GiB
machine (a dozen 8k-token sequences of a 1B model, two of an 8B one), shrinks on small machines, where 2 GiB
could not fit, and grows on large ones. A dedicated server raises the fraction or sets --kv-cache-memory.

Refusals (ValueError, before anything is allocated) are for what certainly cannot fit: weights + the smallest
KV cache (one block per group; one full sequence when max_model_len was set) over the memory available, or an
explicit budget over what the weights leave. An expected peak over the available memory only warns.

A draft model (speculative decoding, `DraftSizing`) counts everywhere: its weights are weights, and its own KV cache,
whose size follows from the target's (as many tokens, at most those of the sequences that draft at once), is KV
memory. The default cap bounds the two caches together; an explicit --kv-cache-memory / --num-kv-blocks sizes the
target's, the draft's coming on top, and the fit checks above count both.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from pagedlm.config import DEFAULT_KV_CACHE_MEMORY_FRACTION, EngineConfig, parse_bytes
from pagedlm.kvcache.block_manager import max_blocks_needed
from pagedlm.kvcache.kv_cache import KVCacheSpec

logger = logging.getLogger(__name__)

CUDA_FREE_FRACTION = 0.8  # of the free device memory after the weights
UNKNOWN_MEMORY_BUDGET = 2 * 2**30  # the cap where the machine does not say how much memory is available
RUNTIME_OVERHEAD = 768 * 2**20  # interpreter, torch, tokenizer, buffers (SmolLM2-135M: RSS - weights - KV = 0.69 GiB)
WEIGHT_OVERHEAD = 0.10  # transients and activations grow with the model's width: a tenth of the weights
_NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a huge number


@dataclass(frozen=True)
class AvailableMemory:
    """Bytes the engine may still take on its device (None: the machine does not say) and where that came from."""

    bytes: int | None
    source: str


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: Path, key: str) -> int:
    """The number after `key` in a `key value [unit]` file (/proc/meminfo, memory.stat); 0 where absent."""
    try:
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) >= 2 and parts[0] == key:
                return int(parts[1])
    except (OSError, ValueError):
        pass
    return 0


def _cgroup_headroom(proc: Path, root: Path) -> int | None:
    """The least headroom (limit - usage + inactive file pages, which the kernel reclaims first) of the process's
    memory cgroup and its ancestors, v2 or v1; None where no limit is set."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    found: list[int] = []
    for line in lines:
        if line.count(":") < 2:
            continue
        _, controllers, rel = line.split(":", 2)
        v2 = controllers == ""
        if not v2 and "memory" not in controllers.split(","):
            continue
        base = root if v2 else root / "memory"
        limit_f, usage_f, inactive = (("memory.max", "memory.current", "inactive_file") if v2 else
                                      ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"))
        d = base / rel.lstrip("/")
        while True:  # the process's own cgroup and every ancestor up to the mount's root
            limit, usage = _read_int(d / limit_f), _read_int(d / usage_f)
            if limit is not None and usage is not None and limit < _NO_LIMIT:
                found.append(max(0, limit - usage + _stat(d / "memory.stat", inactive)))
            if d == base or base not in d.parents:
                break
            d = d.parent
    return min(found) if found else None


def available_memory(proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")) -> AvailableMemory:
    """Host memory available to this process now: the lesser of /proc/meminfo's MemAvailable and the cgroup's
    headroom; where /proc is absent, psutil's `available`, then sysconf's free pages."""
    total = _stat(proc / "meminfo", "MemAvailable:")
    if total:
        mem = AvailableMemory(total * 1024, "MemAvailable")
    else:
        try:
            import psutil

            mem = AvailableMemory(int(psutil.virtual_memory().available), "psutil")
        except ImportError:
            try:
                mem = AvailableMemory(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"), "sysconf")
            except (ValueError, OSError, AttributeError):
                mem = AvailableMemory(None, "unknown")
    headroom = _cgroup_headroom(proc, cgroup_root)
    if headroom is not None and (mem.bytes is None or headroom < mem.bytes):
        mem = AvailableMemory(headroom, "cgroup limit - usage")
    return mem


def checkpoint_bytes(path: Path) -> int:
    """Size on disk of a checkpoint: the GGUF file, or the safetensors files of an HF directory (the weights'
    estimate where the model is not loaded)."""
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def format_bytes(n: float) -> str:
    """1023 B, 1.5 KiB, 2.0 GiB."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{int(n)} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


@dataclass(frozen=True)
class DraftSizing:
    """A draft model's memory: `weight_bytes` of weights and a KV cache of `spec` that holds as many tokens as the
    target's, at most `max_seqs` sequences (those that draft at once) of max_model_len + `num_speculative_tokens`,
    plus a block per sequence and group (each one's partly filled last block)."""

    model: str
    spec: KVCacheSpec
    weight_bytes: int
    max_seqs: int
    num_speculative_tokens: int

    def num_blocks(self, target_tokens: int, max_model_len: int) -> int:
        tokens = min(target_tokens, self.max_seqs * (max_model_len + self.num_speculative_tokens))
        return len(self.spec.groups) * (-(-tokens // self.spec.block_size) + self.max_seqs)


@dataclass(frozen=True)
class KVSizing:
    """What the KV budget depends on. `max_model_len` is the length sequences are sized for (the model's
    context unless set: `max_model_len_explicit`); `max_chunk` the most tokens prefilled in one step."""

    spec: KVCacheSpec
    max_model_len: int
    max_num_seqs: int
    weight_bytes: int
    max_chunk: int | None = None
    kv_cache_memory: int | None = None
    num_kv_blocks: int | None = None
    max_model_len_explicit: bool = False
    fraction: float = DEFAULT_KV_CACHE_MEMORY_FRACTION
    device_type: str = "cpu"
    draft: DraftSizing | None = None

    @classmethod
    def for_config(cls, config: EngineConfig, spec: KVCacheSpec, context_length: int, weight_bytes: int,
                   device_type: str = "cpu", draft: DraftSizing | None = None) -> KVSizing:
        """The engine's sizing: max_model_len defaults to the model's context (and is clipped to it)."""
        budget = None if config.kv_cache_memory is None else parse_bytes(config.kv_cache_memory)
        return cls(spec, min(config.max_model_len or context_length, context_length), config.max_num_seqs,
                   weight_bytes, max_chunk=config.max_num_batched_tokens, kv_cache_memory=budget,
                   num_kv_blocks=config.num_kv_blocks, max_model_len_explicit=config.max_model_len is not None,
                   fraction=config.kv_cache_memory_fraction, device_type=device_type, draft=draft)

    @property
    def all_weight_bytes(self) -> int:
        """The target's weights and the draft model's."""
        return self.weight_bytes + (self.draft.weight_bytes if self.draft is not None else 0)

    def draft_blocks(self, num_blocks: int) -> int:
        """The draft model's KV blocks beside `num_blocks` of the target's (0 without a draft model)."""
        if self.draft is None:
            return 0
        return self.draft.num_blocks(num_blocks * self.spec.block_size // len(self.spec.groups), self.max_model_len)

    def kv_bytes(self, num_blocks: int) -> int:
        """KV memory of `num_blocks` target blocks and the draft's cache beside them."""
        draft = self.draft_blocks(num_blocks) * self.draft.spec.bytes_per_block if self.draft is not None else 0
        return num_blocks * self.spec.bytes_per_block + draft

    def blocks_within(self, budget_bytes: int) -> int:
        """The most target blocks whose KV, with the draft's, fits in `budget_bytes`."""
        lo, hi = 0, max(budget_bytes, 0) // self.spec.bytes_per_block
        if self.draft is None:
            return hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if self.kv_bytes(mid) <= budget_bytes else (lo, mid - 1)
        return lo

    def blocks_per_seq(self) -> int:
        s = self.spec
        return max_blocks_needed(s.sliding_windows, s.block_size, self.max_model_len, self.max_model_len, 1,
                                 self.max_chunk)

    @property
    def overhead_bytes(self) -> int:
        return RUNTIME_OVERHEAD + int(WEIGHT_OVERHEAD * self.all_weight_bytes)


@dataclass(frozen=True)
class KVBudget:
    """The chosen KV cache (`num_blocks` of `bytes_per_block`) and how it was chosen (`choice`), with the numbers
    the start-up report shows. `demand` / `cap` (the target's KV and the draft's) are 0 where they played no part.
    With a draft model, its weights and its KV cache (`draft_blocks` of `draft_bytes_per_block`)."""

    num_blocks: int
    bytes_per_block: int
    choice: str
    demand: int
    cap: int
    weight_bytes: int
    overhead_bytes: int
    available: AvailableMemory
    draft_blocks: int = 0
    draft_bytes_per_block: int = 0
    draft_weight_bytes: int = 0

    @property
    def kv_bytes(self) -> int:
        return self.num_blocks * self.bytes_per_block

    @property
    def draft_kv_bytes(self) -> int:
        return self.draft_blocks * self.draft_bytes_per_block

    @property
    def expected_peak(self) -> int:
        return self.weight_bytes + self.draft_weight_bytes + self.kv_bytes + self.draft_kv_bytes + self.overhead_bytes


def _refuse(what: str, need: int, sizing: KVSizing, mem: AvailableMemory, fix: str) -> ValueError:
    f, w = format_bytes, sizing.all_weight_bytes
    weights = (f"the weights ({f(w)})" if sizing.draft is None else
               f"the weights ({f(w)}: the target's {f(sizing.weight_bytes)}, the draft model's "
               f"{f(sizing.draft.weight_bytes)})")
    if sizing.draft is not None:
        what += " with the draft model's"
    return ValueError(f"{what} ({f(need)}) and {weights} need {f(need + w)}, but only {f(mem.bytes or 0)} of memory "
                      f"is available ({mem.source}); {fix}.")


def plan_kv_budget(sizing: KVSizing, mem: AvailableMemory) -> KVBudget:
    """The KV blocks to allocate for `sizing` on a device with `mem` available (host memory before the weights
    were loaded; on CUDA the free device memory after). Raises ValueError, naming the numbers and the flags to
    change, for a configuration that cannot fit (see the module docstring). Sizes compared with a budget are the
    target's KV and the draft model's together (`KVSizing.kv_bytes`)."""
    spec, per_block = sizing.spec, sizing.spec.bytes_per_block
    seq_blocks = sizing.blocks_per_seq()
    one_seq, demand = sizing.kv_bytes(seq_blocks), sizing.kv_bytes(sizing.max_num_seqs * seq_blocks)
    draft = sizing.draft

    def budget(blocks: int, choice: str, demand: int = 0, cap: int = 0, terms: str = "") -> KVBudget:
        return KVBudget(blocks, per_block, choice + (f" ({terms})" if terms else ""), demand, cap,
                        sizing.weight_bytes, sizing.overhead_bytes, mem, sizing.draft_blocks(blocks),
                        draft.spec.bytes_per_block if draft is not None else 0,
                        draft.weight_bytes if draft is not None else 0)

    if sizing.device_type == "cuda":
        if sizing.num_kv_blocks is not None:
            return budget(sizing.num_kv_blocks, "explicit (--num-kv-blocks)")
        if sizing.kv_cache_memory is not None:
            return budget(spec.num_blocks_for(sizing.kv_cache_memory), "explicit (--kv-cache-memory)")
        cap = int((mem.bytes or 0) * CUDA_FREE_FRACTION)
        return budget(sizing.blocks_within(cap), f"default: {CUDA_FREE_FRACTION:.0%} of the free device memory",
                      cap=cap)

    known = mem.bytes is not None
    room = (mem.bytes or 0) - sizing.all_weight_bytes  # what the weights leave for the KV caches and the overhead
    least = sizing.kv_bytes(seq_blocks if sizing.max_model_len_explicit else len(spec.groups))
    if known and least > room:
        what = (f"The KV cache of one sequence of max_model_len {sizing.max_model_len:,} tokens"
                if sizing.max_model_len_explicit else "The smallest KV cache (one block per layer group)")
        fix = "use a smaller or more quantized model, or free memory"
        raise _refuse(what, least, sizing, mem, f"lower --max-model-len, {fix}" if room > 0 else fix)
    if sizing.num_kv_blocks is not None or sizing.kv_cache_memory is not None:
        explicit = sizing.num_kv_blocks is not None
        blocks = sizing.num_kv_blocks if explicit else spec.num_blocks_for(sizing.kv_cache_memory)
        flag = "--num-kv-blocks" if explicit else "--kv-cache-memory"
        if known and sizing.kv_bytes(blocks) > room:
            most = sizing.blocks_within(room) * per_block
            raise _refuse(f"The KV cache asked for ({flag})", sizing.kv_bytes(blocks), sizing, mem,
                          f"lower {flag} (at most {format_bytes(max(most, 0))} fits next to the weights)")
        return budget(blocks, f"explicit ({flag})")
    cap = int(sizing.fraction * room) if known else UNKNOWN_MEMORY_BUDGET
    terms = (f"demand {sizing.max_num_seqs} x {sizing.max_model_len:,} tokens"
             + (" with the draft model's KV" if draft is not None else "") + f" = {format_bytes(demand)}, cap "
             + (f"{sizing.fraction:g} x (available - weights)" if known else "for an unknown available memory")
             + f" = {format_bytes(cap)}")
    if demand <= cap:
        return budget(sizing.max_num_seqs * seq_blocks, "default: the demand", demand, cap, terms)
    if cap < one_seq and (sizing.max_model_len_explicit or known and one_seq <= room - sizing.overhead_bytes):
        return budget(seq_blocks, f"default: one sequence of {sizing.max_model_len:,} tokens, over the cap",
                      demand, cap, terms)
    return budget(max(sizing.blocks_within(cap), len(spec.groups)), "default: the cap", demand, cap, terms)


def check_peak(budget: KVBudget) -> None:
    """Warn where the expected peak exceeds the memory available (the configuration fits, but only just)."""
    f = format_bytes
    if budget.available.bytes is not None and budget.expected_peak > budget.available.bytes:
        logger.warning("The expected peak (%s: weights %s + KV %s + overhead %s) exceeds the %s available; lower "
                       "--kv-cache-memory or --max-model-len if the process runs out of memory.",
                       f(budget.expected_peak), f(budget.weight_bytes + budget.draft_weight_bytes),
                       f(budget.kv_bytes + budget.draft_kv_bytes), f(budget.overhead_bytes),
                       f(budget.available.bytes))
