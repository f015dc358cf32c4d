"""What the CPU can do, read once from /proc/cpuinfo."""
from __future__ import annotations

import functools
from dataclasses import dataclass


@dataclass(frozen=True)
class CpuFeatures:
    flags: frozenset[str]

    @property
    def native_bf16(self) -> bool:
        return bool(self.flags & {"avx512_bf16", "amx_bf16"})

    def describe(self) -> str:
        wanted = ("avx2", "fma", "avx512f", "avx512bw", "avx512_vnni", "avx_vnni", "avx512_bf16", "amx_bf16",
                  "amx_int8")
        return " ".join(f for f in wanted if f in self.flags) or "no AVX2"


@functools.lru_cache(maxsize=1)
def cpu_features() -> CpuFeatures:
    """The CPU's feature flags, from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        line = ""
    return CpuFeatures(frozenset(line.partition(":")[2].split()))
