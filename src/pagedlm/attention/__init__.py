"""Paged attention backends: objects with the AttentionBackend contract (backend.py) that write a layer's new K/V
into the paged cache and read the batch's queries against it, given the batch's AttentionMetadata.

"cpu": the compiled kernel (cpu_kernel.py), K/V read in place, and the one backend the fused decoder stack may
replace; "sdpa": torch SDPA per sequence over gathered K/V, on any device; "reference": the oracle. "auto" picks
"cpu" on CPU where the kernel builds, else "sdpa".
"""
from __future__ import annotations

import logging

from pagedlm.attention.backend import AttentionBackend
from pagedlm.attention.cpu_kernel import CpuKernelBackend, load_kernel
from pagedlm.attention.metadata import AttentionMetadata
from pagedlm.attention.reference import ReferenceBackend, write_kv
from pagedlm.attention.torch_sdpa import SdpaBackend

logger = logging.getLogger(__name__)

BACKENDS: dict[str, AttentionBackend] = {b.name: b for b in (ReferenceBackend(), SdpaBackend(), CpuKernelBackend())}


def get_attention_backend(name: str = "auto", device: str = "cpu") -> AttentionBackend:
    if name == "auto":
        if str(device).startswith("cpu") and load_kernel() is not None:
            name = "cpu"
        else:
            name = "sdpa"
            if str(device).startswith("cpu"):
                logger.warning("Falling back to the 'sdpa' attention backend.")
        logger.info("Attention backend: %s", name)
    if name not in BACKENDS:
        raise ValueError(f"attention_backend must be one of {sorted(BACKENDS)} or 'auto', got {name!r}.")
    return BACKENDS[name]


__all__ = ["AttentionBackend", "AttentionMetadata", "BACKENDS", "get_attention_backend", "write_kv"]
