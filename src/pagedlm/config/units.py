"""Units of the configuration: dtypes by name and memory sizes (`2GiB`)."""
from __future__ import annotations

import argparse

import torch

DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        return default_dtype()
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {dtype!r}.")
    return DTYPES[dtype]


def default_dtype() -> torch.dtype:
    """bf16 where the hardware runs it natively (CUDA, CPUs with AVX512-BF16/AMX), else fp32."""
    if torch.cuda.is_available():
        return torch.bfloat16
    from pagedlm.cpu import cpu_features

    return torch.bfloat16 if cpu_features().native_bf16 else torch.float32


_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 2**10, "mib": 2**20, "gib": 2**30}


def parse_bytes(value: int | float | str) -> int:
    """`2GiB`, `512MiB`, `1e9` or a plain number of bytes. Plain numbers below 1024 are GiB (vLLM style)."""
    if isinstance(value, (int, float)):
        return int(value * 2**30) if value < 1024 else int(value)
    s = value.strip().lower().replace(" ", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = s[len(num):]
    if unit not in _UNITS or not num:
        raise ValueError(f"Cannot parse a memory size from {value!r} (use e.g. '2GiB', '512MiB' or bytes).")
    n = float(num)
    return int(n * 2**30) if unit == "" and n < 1024 else int(n * _UNITS[unit])


def byte_size(value: str) -> str:
    """A memory size flag (`2GiB`, `512MiB`, bytes), checked here and kept as written (parse_bytes reads it)."""
    try:
        parse_bytes(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


DTYPE_NAMES = ("auto", *DTYPES)
