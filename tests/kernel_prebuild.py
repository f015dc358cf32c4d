"""Build, two at a time, every kernel library the test suite loads on this CPU: the native ones and the variants
the ISA-path tests compile (-march=haswell, x86-64, skylake-avx512 and the emulated AVX-512 build where this CPU
runs them). conftest.py starts it at low priority when a session begins, so the compiles (about two minutes of
one core on a clean machine) overlap the tests; a test that needs a library being built waits for that build
(cbuild.build's lock) instead of compiling it again. Run as `python tests/kernel_prebuild.py`."""
from __future__ import annotations

import platform
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from pagedlm import cbuild
from pagedlm.cpu import cpu_flags


def builds() -> list[tuple[Path, str]]:
    """(source, march): the native builds first (the suite's first engine needs all four: the longest compile,
    the fused decoder's, starts at once beside attention's), then the variants."""
    from pagedlm.attention import cpu_kernel
    from pagedlm.model import llama_decode
    from pagedlm.model.quant import kernel as quant_kernel
    from pagedlm.sampling import logits_kernel

    attention, quant, logits = cpu_kernel.SOURCE, quant_kernel.SOURCE, logits_kernel.SOURCE
    out = [(llama_decode.SOURCE, "native"), (attention, "native"), (quant, "native"), (logits, "native"),
           (Path(__file__).parent / "csrc" / "pool_probe.cpp", "native")]
    if platform.machine() != "x86_64":
        return out
    flags = cpu_flags()
    avx2 = {"avx2", "fma", "f16c", "bmi2"} <= flags
    marches = [m for m, runs in [("haswell", avx2), ("x86-64", True),
                                 (cbuild.EMULATED_AVX512, avx2 and cbuild.emulation_available()),
                                 ("skylake-avx512", avx2 and {"avx512f", "avx512dq", "avx512bw", "avx512vl"} <= flags)]
               if runs]
    out += [(attention, m) for m in marches]
    out += [(source, m) for source in (quant, logits) for m in marches if m != "skylake-avx512"]
    return out


def main() -> None:
    try:
        cbuild.compiler()
    except RuntimeError:  # no g++: the kernels' tests skip or take their fallbacks
        return
    with ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda b: _try(*b), builds()))


def _try(source: Path, march: str) -> None:
    try:
        cbuild.build(source, march)
    except Exception:  # noqa: BLE001 - the test that loads it reports the failure
        pass


if __name__ == "__main__":
    main()
