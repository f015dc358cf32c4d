"""The sampler's row reductions in one compiled kernel (csrc/logits.cpp): each row's greedy token (the first index
of its maximum, as `torch.argmax`) and its log-sum-exp, for fp32 logits on the CPU. torch spends three kernels on
that (argmax, which it does not vectorize, then the max and exp-sum of logsumexp): 6 ms for 64 rows of a 49k
vocabulary on 2 cores, against well under 1 ms here. Anything the kernel does not take (another device or dtype,
a NaN or an infinite maximum in a row, no compiler) goes through torch, with torch's results."""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from pagedlm import cbuild

SOURCE = Path(__file__).parent / "csrc" / "logits.cpp"


def _configure(lib: ctypes.CDLL) -> None:
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    lib.pagedlm_argmax_logsumexp.argtypes = [p, i64, i64, i64, p, p, ctypes.c_int]
    lib.pagedlm_argmax_logsumexp.restype = ctypes.c_int
    lib.pagedlm_logits_isa.argtypes, lib.pagedlm_logits_isa.restype = [], ctypes.c_int


KERNEL = cbuild.KernelLibrary(SOURCE, "sampler row kernel", "argmax and logsumexp run in torch", _configure)
_VARIANTS = {"native": KERNEL}


def kernel_variant(march: str) -> cbuild.KernelLibrary:
    """The kernel compiled with `-march=<march>` ("native" is KERNEL), so that tests can run each ISA path."""
    return _VARIANTS.setdefault(march, cbuild.KernelLibrary(SOURCE, f"sampler row kernel ({march})",
                                                            "argmax and logsumexp run in torch", _configure,
                                                            march=march))


def argmax_logsumexp_kernel(x: torch.Tensor, lib: ctypes.CDLL) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(tokens int64 [N], logsumexp fp32 [N]) of CPU fp32 logits [N, V] with unit stride, by `lib`; None where the
    kernel declines (a NaN or an infinite maximum in some row)."""
    n, v = x.shape
    tokens = torch.empty(n, dtype=torch.int64)
    lse = torch.empty(n, dtype=torch.float32)
    rc = lib.pagedlm_argmax_logsumexp(x.data_ptr(), n, v, x.stride(0), tokens.data_ptr(), lse.data_ptr(),
                                      torch.get_num_threads())
    return (tokens, lse) if rc == 0 else None


def argmax_logsumexp(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's greedy token and log-sum-exp, for logits [N, V] of any float dtype (computed in fp32):
    `(x.argmax(-1), x.logsumexp(-1))` up to rounding of the sums."""
    x = x.float()
    lib = KERNEL.load() if x.device.type == "cpu" and x.dim() == 2 and x.shape[1] > 0 else None
    if lib is not None and x.stride(1) == 1 and x.stride(0) >= x.shape[1]:
        out = argmax_logsumexp_kernel(x, lib)
        if out is not None:
            return out
    return x.argmax(-1), x.logsumexp(-1)
