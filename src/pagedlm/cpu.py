"""What the CPU can do, read once from /proc/cpuinfo, less what PAGEDLM_ISA hides.

PAGEDLM_ISA=avx2 runs pagedlm as on a CPU without AVX-512, AVX-VNNI or AMX (a Zen 3, a Haswell to Raptor Lake
without their VNNI): the kernels are built with -march=haswell, the plan sees the CPU's flags without those
extensions, and pagedlm/__init__.py asks torch and oneDNN for AVX2 too (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA,
unless set). So an AVX-512 machine can measure and test the AVX2 paths end to end. Unset or "native": all of it."""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

ISA_LEVELS = {"native": "native", "avx2": "haswell"}  # PAGEDLM_ISA -> the kernels' -march
ABOVE_AVX2 = ("avx512", "amx", "avx_", "avx10")  # flag prefixes an AVX2-level CPU lacks (avx_vnni, avx_ifma, ...)


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


def isa_level() -> str:
    """PAGEDLM_ISA's value ("native" where unset); ValueError for anything ISA_LEVELS lacks."""
    level = os.environ.get("PAGEDLM_ISA", "").strip().lower() or "native"
    if level not in ISA_LEVELS:
        raise ValueError(f"PAGEDLM_ISA must be one of {', '.join(ISA_LEVELS)}; got {level!r}.")
    return level


def kernel_march() -> str:
    """The -march that "native" kernel builds use: "native", or "haswell" under PAGEDLM_ISA=avx2."""
    return ISA_LEVELS[isa_level()]


def limit_flags(flags: frozenset[str], level: str) -> frozenset[str]:
    """`flags` as a CPU of `level` would show them; ValueError where the CPU lacks that level."""
    if level == "native":
        return flags
    if not {"avx2", "fma"} <= flags:
        raise ValueError(f"PAGEDLM_ISA={level}: this CPU has no AVX2 and FMA to run at that level.")
    return frozenset(f for f in flags if not f.startswith(ABOVE_AVX2))


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's own feature flags, from /proc/cpuinfo (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith("flags")), "")
    except OSError:
        line = ""
    return frozenset(line.partition(":")[2].split())


@functools.lru_cache(maxsize=1)
def cpu_features() -> CpuFeatures:
    """What pagedlm may use: the CPU's flags, limited by PAGEDLM_ISA."""
    flags = cpu_flags()
    return CpuFeatures(limit_flags(flags, isa_level()) if flags else flags)
