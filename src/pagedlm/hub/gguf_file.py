"""A GGUF file's header in one pass: its metadata as Python values, its tensors as memory-mapped numpy arrays.

gguf-py's `GGUFReader` builds a numpy view for every element of every metadata array, so opening Gemma 3's GGUF
(a 262,144-token vocabulary: strings, scores and types) takes about 20 s on a 2-core machine and SmolLM2's 4 s;
this reads the same header in well under a second and checks the file's structure on the way (every tensor's data
inside the file, a power-of-two alignment). Tensor data follow gguf-py's conventions, so `gguf.quants.dequantize`
takes them as they are: F32 / F16 / F64 / I8..I64 tensors as arrays of that dtype, every other type as the bytes
of its blocks (uint8, last dimension in bytes), shapes in numpy order.
"""
from __future__ import annotations

import math
import mmap
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf
import numpy as np

__all__ = ["GGUFFile", "GGUFFormatError", "GGUFTensor", "read_gguf"]

_SCALAR = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_NUMPY = {0: "u1", 1: "i1", 2: "u2", 3: "i2", 4: "u4", 5: "i4", 6: "f4", 7: "?", 10: "u8", 11: "i8", 12: "f8"}
_STRING, _ARRAY = 8, 9
_MAX_NESTING = 8  # arrays of arrays: a malformed file must not exhaust the stack
# Values in all metadata arrays together: each becomes a Python object (30-40x its bytes in the file), so a crafted
# header must not turn into GBs. Real ones hold a few: Gemma 3's vocabulary (262,144 tokens, scores and types) ~0.8M.
MAX_METADATA_VALUES = 1 << 22
_PLAIN_TENSORS = {gguf.GGMLQuantizationType.F32: "f4", gguf.GGMLQuantizationType.F16: "f2",
                  gguf.GGMLQuantizationType.F64: "f8", gguf.GGMLQuantizationType.I8: "i1",
                  gguf.GGMLQuantizationType.I16: "i2", gguf.GGMLQuantizationType.I32: "i4",
                  gguf.GGMLQuantizationType.I64: "i8"}


class GGUFFormatError(ValueError):
    """The file is not a complete, well-formed GGUF (version 2 or 3)."""


@dataclass(frozen=True)
class GGUFTensor:
    name: str
    shape: tuple[int, ...]  # GGUF order: the fastest-varying dimension first
    tensor_type: gguf.GGMLQuantizationType
    data: np.ndarray  # read-only view of the file
    offset: int = 0  # of its data in the file

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))


@dataclass(frozen=True)
class GGUFFile:
    path: Path
    fields: dict[str, Any]  # key -> int / float / bool / str, or a list of them for an array
    tensors: list[GGUFTensor]
    alignment: int
    mapping: mmap.mmap | None = field(default=None, repr=False, compare=False)
    little_endian: bool = True

    @property
    def scalars(self) -> dict[str, Any]:
        """The metadata but its arrays (the vocabulary, the merges) and non-finite numbers: Ollama's /api/show
        `model_info`, which JSON can carry."""
        return {k: v for k, v in self.fields.items()
                if not isinstance(v, list) and not (isinstance(v, float) and not math.isfinite(v))}

    @property
    def file_type(self) -> str:
        """The file's type as llama.cpp and Ollama name it (`Q4_K_M`, `Q8_0`, `F16`; empty when the header has none
        or an unknown one): `general.file_type`, the type most of its weights have."""
        try:
            name = gguf.LlamaFileType(self.fields.get("general.file_type")).name
        except ValueError:
            return ""
        return {"ALL_F32": "F32", "GUESSED": ""}.get(name, name.removeprefix("MOSTLY_"))

    def release(self, tensor: GGUFTensor, start: int = 0, nbytes: int | None = None) -> None:
        """Unmap the pages of `tensor`'s data (bytes `start` .. `start + nbytes` of it, None: to its end) from this
        process; they stay in the page cache and are read again if the data is touched again: once a tensor has
        been converted, its file pages need not count in the process's resident memory beside the converted copy."""
        if self.mapping is None or not hasattr(self.mapping, "madvise"):
            return
        page = mmap.PAGESIZE
        first = tensor.offset + start
        start, end = first // page * page, tensor.offset + (tensor.data.nbytes if nbytes is None else start + nbytes)
        end = min(end, len(self.mapping))
        if end > start:
            self.mapping.madvise(mmap.MADV_DONTNEED, start, end - start)


class _Cursor:
    def __init__(self, buf, order: str):
        self.buf, self.order, self.pos = buf, order, 24
        self.values = 0  # array values read so far (MAX_METADATA_VALUES)

    def take(self, fmt: str):
        fmt = self.order + fmt
        size = struct.calcsize(fmt)
        if self.pos + size > len(self.buf):
            raise GGUFFormatError("truncated header")
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.take("Q")
        if self.pos + n > len(self.buf):
            raise GGUFFormatError("truncated header")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row (a tokenizer's vocabulary and merges: 100k+), in one tight loop."""
        buf, pos, end = self.buf, self.pos, len(self.buf)
        length = struct.Struct(self.order + "Q").unpack_from
        out = []
        append = out.append
        for _ in range(count):
            if pos + 8 > end:
                raise GGUFFormatError("truncated header")
            (n,) = length(buf, pos)
            pos += 8
            if pos + n > end:
                raise GGUFFormatError("truncated header")
            append(str(buf[pos:pos + n], "utf-8", "replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int, depth: int = 0) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            itype, count = self.take("I"), self.take("Q")
            self.values += count
            if self.values > MAX_METADATA_VALUES:
                raise GGUFFormatError(f"metadata arrays hold more than {MAX_METADATA_VALUES:,} values")
            if itype in _NUMPY:
                dtype = np.dtype(self.order + _NUMPY[itype])
                end = self.pos + count * dtype.itemsize
                if end > len(self.buf):
                    raise GGUFFormatError("truncated header")
                values = np.frombuffer(self.buf, dtype, count, self.pos).tolist()
                self.pos = end
                return values
            if itype == _STRING:
                return self.strings(count)
            if depth >= _MAX_NESTING:
                raise GGUFFormatError(f"arrays nested more than {_MAX_NESTING} deep")
            return [self.value(itype, depth + 1) for _ in range(count)]
        if vtype not in _SCALAR:
            raise GGUFFormatError(f"unknown metadata value type {vtype}")
        return self.take(_SCALAR[vtype])


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Parse `path`'s header and map its tensors (the file stays mapped while any array of it is alive).

    Raises GGUFFormatError for anything that is not a complete GGUF, OSError if it cannot be read."""
    path = Path(path)
    with open(path, "rb") as f:
        if os.fstat(f.fileno()).st_size == 0:
            raise GGUFFormatError("empty file")
        mapping = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        buf = np.frombuffer(mapping, np.uint8)
    raw = memoryview(buf)
    if len(buf) < 24 or bytes(raw[:4]) != b"GGUF":
        raise GGUFFormatError("bad magic")
    order = "<" if struct.unpack_from("<I", raw, 4)[0] & 0xFFFF else ">"
    (version,) = struct.unpack_from(order + "I", raw, 4)
    if version not in (2, 3):
        raise GGUFFormatError(f"unsupported GGUF version {version}")
    n_tensors, n_kv = struct.unpack_from(order + "QQ", raw, 8)
    cur = _Cursor(raw, order)
    fields: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        fields[key] = cur.value(cur.take("I"))
    alignment = fields.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
    if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment < 1 or alignment & (alignment - 1):
        raise GGUFFormatError(f"general.alignment must be a power of two, got {alignment!r}")
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        shape = tuple(cur.take("Q") for _ in range(cur.take("I")))
        try:
            ttype = gguf.GGMLQuantizationType(cur.take("I"))
        except ValueError as e:
            raise GGUFFormatError(f"tensor {name!r}: {e}") from None
        infos.append((name, shape, ttype, cur.take("Q")))
    start = -(-cur.pos // alignment) * alignment
    tensors = []
    for name, shape, ttype, offset in infos:
        n = int(np.prod(shape, dtype=np.int64))
        block, type_size = gguf.GGML_QUANT_SIZES[ttype]
        if n % block or (shape and shape[0] % block):
            raise GGUFFormatError(f"tensor {name!r}: {shape} is not a whole number of {ttype.name} blocks")
        nbytes = n // block * type_size
        at = start + offset
        if at + nbytes > len(buf):
            raise GGUFFormatError(f"truncated: tensor data needs {at + nbytes} bytes, file has {len(buf)}")
        dims = tuple(reversed(shape))
        if ttype in _PLAIN_TENSORS:
            data = buf[at:at + nbytes].view(np.dtype(order + _PLAIN_TENSORS[ttype])).reshape(dims)
        else:
            data = buf[at:at + nbytes].reshape(*dims[:-1], dims[-1] // block * type_size) if dims else buf[at:at]
        tensors.append(GGUFTensor(name, shape, ttype, data, at))
    return GGUFFile(path, fields, tensors, alignment, mapping, order == "<")
