"""A checkpoint's quantized blocks as read, kept in their own format: GGUF's quantized linear weights come as
`RawBlocks` (the file's bytes), which model/quant/'s layers convert in one pass into the layouts their kernels run
(int4 kinds also through `Int4Blocks`); `LazyRows` are other GGUF matrices, dequantized a few rows at a time by
whoever converts them (a 128k-row vocabulary table in fp32 would be GBs)."""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import gguf
import numpy as np
import torch

if TYPE_CHECKING:
    from pagedlm.hub.gguf_file import GGUFFile, GGUFTensor


@dataclass
class Int4Blocks:
    """An int4 weight in the layout `quantize_int4` produces (groups of 32): packed nibbles [N, K/2] uint8, scale
    and minimum [N, K/32] fp16, weight = q * scale + min. GGUF's Q4_1 blocks are exactly this (d, m, 16 bytes of
    nibbles, values 0..15 low, 16..31 high) and Q4_0's are too with min = -8 * scale, so a GGUF's Q4_0 / Q4_1
    weights are loaded as they are stored (`from_gguf`) rather than dequantized and quantized again. Q4_K's
    super-blocks of 256 are eight such groups whose scale and minimum are 6-bit multiples of two fp16 factors
    (d * sc, -dmin * m): the codes are kept, the products rounded to fp16 (2^-11 relative: on Gemma 3's weights
    none moves by more than 1.5% of its quantization step)."""

    qweight: torch.Tensor
    scale: torch.Tensor
    mins: torch.Tensor

    @property
    def shape(self) -> tuple[int, int]:
        return self.qweight.shape[0], self.qweight.shape[1] * 2

    @classmethod
    def from_gguf(cls, raw: np.ndarray, kind: str) -> "Int4Blocks":
        """`raw`: a Q4_0 / Q4_1 / Q4_K tensor's bytes, [rows, blocks_per_row * block_bytes] uint8."""
        if kind == "Q4_K":
            return cls._from_q4_k(raw)
        rows = raw.shape[0]
        head = {"Q4_0": 2, "Q4_1": 4}[kind]
        blocks = np.ascontiguousarray(raw).reshape(rows, -1, head + 16)
        scale = torch.from_numpy(blocks[:, :, 0:2].copy().view(np.float16)[..., 0])
        mins = (torch.from_numpy(blocks[:, :, 2:4].copy().view(np.float16)[..., 0]) if kind == "Q4_1"
                else scale * -8.0)
        qs = torch.from_numpy(blocks[:, :, head:].copy()).reshape(rows, -1)
        return cls(qs.contiguous(), scale.contiguous(), mins.contiguous())

    @classmethod
    def _from_q4_k(cls, raw: np.ndarray) -> "Int4Blocks":
        # A super-block: d, dmin (fp16), 12 bytes of 6-bit (scale, min) pairs for its 8 groups, then 4 runs of 32
        # bytes, run i holding group 2i in its low nibbles and group 2i + 1 in its high ones (value j at byte j).
        rows = raw.shape[0]
        sb = np.ascontiguousarray(raw).reshape(rows, -1, 144)
        d = sb[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
        dmin = sb[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
        s = sb[..., 4:16].astype(np.uint8)
        sc = np.concatenate([s[..., 0:4] & 63, (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)], axis=-1)
        mn = np.concatenate([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], axis=-1)
        qs = sb[..., 16:].reshape(rows, -1, 4, 32)
        codes = np.stack([qs & 0x0F, qs >> 4], axis=3).reshape(rows, -1, 32)  # [rows, groups, 32]
        packed = codes[..., :16] | (codes[..., 16:] << 4)  # the Q4_1 order: values j and j + 16 share byte j
        scale = (d[..., None] * sc).astype(np.float16).reshape(rows, -1)
        mins = (-(dmin[..., None] * mn)).astype(np.float16).reshape(rows, -1)
        return cls(torch.from_numpy(packed.reshape(rows, -1).astype(np.uint8)), torch.from_numpy(scale),
                   torch.from_numpy(mins))

    def rows(self, perm: np.ndarray) -> "Int4Blocks":
        idx = torch.from_numpy(perm)
        return Int4Blocks(self.qweight[idx].contiguous(), self.scale[idx].contiguous(), self.mins[idx].contiguous())

    @staticmethod
    def cat(parts: list["Int4Blocks"]) -> "Int4Blocks":
        return Int4Blocks(*(torch.cat([getattr(p, f) for p in parts]) for f in ("qweight", "scale", "mins")))


INT4_KINDS = ("Q4_0", "Q4_1", "Q4_K")


@dataclass
class RawBlocks:
    """GGUF quantized rows not yet converted (Q4_0 / Q4_1 / Q4_K, INT4_KINDS, and the 5- to 8-bit kinds model/quant/
    runs natively too): `parts` (raw [rows, blocks * bytes] uint8, kind, row permutation or None), stacked in order
    (a fused q/k/v). model/quant/ writes its x16 layouts straight from the raw bytes where its kernel runs (one
    pass; each kind's own scales: see `kinds`); `blocks()` converts int4 kinds to Int4Blocks, `dequantize()` any.
    `names`: the file's tensor name of each part (empty where unknown), which `source` turns into the key of the
    converted weight in the repacked-weight cache (model/weight_cache.py)."""

    parts: list[tuple[np.ndarray, str, np.ndarray | None]]
    cols: int
    releases: list[Callable[[], None]] = field(default_factory=list)  # unmap the file's pages once converted
    names: list[str] = field(default_factory=list)

    @classmethod
    def from_gguf(cls, raw: np.ndarray, kind: str, cols: int, release: Callable[[], None] | None = None,
                  name: str | None = None) -> "RawBlocks":
        return cls([(raw, kind, None)], cols, [release] if release else [], [name] if name else [])

    @property
    def source(self) -> str | None:
        """What the rows are, as a string: each part's tensor name, kind, row count and row permutation (a digest),
        None where a part's name is unknown."""
        if len(self.names) != len(self.parts):
            return None

        def part(name: str, raw: np.ndarray, kind: str, perm: np.ndarray | None) -> str:
            order = "" if perm is None else f":perm{zlib.crc32(np.ascontiguousarray(perm, dtype=np.int64)):08x}"
            return f"{name}:{kind}:{raw.shape[0]}x{self.cols}{order}"

        return "+".join(part(name, *p) for name, p in zip(self.names, self.parts))

    def converted(self) -> None:
        """The raw bytes are no longer needed: release the file's pages."""
        for release in self.releases:
            release()

    @property
    def shape(self) -> tuple[int, int]:
        return sum(raw.shape[0] for raw, _, _ in self.parts), self.cols

    @property
    def kinds(self) -> set[str]:
        return {kind for _, kind, _ in self.parts}

    def rows(self, perm: np.ndarray) -> "RawBlocks":
        (raw, kind, old), = self.parts
        return RawBlocks([(raw, kind, perm if old is None else old[perm])], self.cols, self.releases, self.names)

    @staticmethod
    def cat(parts: list["RawBlocks"]) -> "RawBlocks":
        named = all(len(part.names) == len(part.parts) for part in parts)
        return RawBlocks([p for part in parts for p in part.parts], parts[0].cols,
                         [r for part in parts for r in part.releases],
                         [n for part in parts for n in part.names] if named else [])

    def dequantize(self) -> torch.Tensor:
        """The weight in fp32 exactly as the file's blocks define it (gguf-py's dequantization)."""
        out = []
        for raw, kind, perm in self.parts:
            w = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind]).reshape(raw.shape[0], self.cols)
            out.append(w if perm is None else w[perm])
        self.converted()
        return torch.from_numpy(np.ascontiguousarray(np.concatenate(out), dtype=np.float32))

    def blocks(self) -> Int4Blocks:
        out = []
        for raw, kind, perm in self.parts:
            b = Int4Blocks.from_gguf(raw, kind)
            out.append(b if perm is None else b.rows(perm))
        self.converted()
        return out[0] if len(out) == 1 else Int4Blocks.cat(out)


@dataclass
class LazyRows:
    """A GGUF matrix [rows, cols] read on demand: `rows[i:j]` is those rows dequantized to fp32 (their file pages
    are released once read, see `GGUFFile.release`); `materialize()` the whole matrix."""

    reader: GGUFFile
    tensor: GGUFTensor
    dtype = torch.float32

    @property
    def shape(self) -> tuple[int, int]:
        cols, rows = self.tensor.shape
        return rows, cols

    @property
    def source(self) -> str:
        """The matrix's identity in its file (a key of the repacked-weight cache, model/weight_cache.py)."""
        return f"{self.tensor.name}:{self.tensor.tensor_type.name}:{self.shape[0]}x{self.shape[1]}"

    def __getitem__(self, rows: slice) -> torch.Tensor:
        start, stop, _ = rows.indices(self.shape[0])
        data = self.tensor.data[start:stop]
        out = gguf.quants.dequantize(data, self.tensor.tensor_type).reshape(stop - start, self.shape[1])
        self.release(start, stop)
        if not (out.flags.writeable and out.flags.c_contiguous and out.dtype == np.float32):  # e.g. an F32 view
            out = np.array(out, dtype=np.float32)
        return torch.from_numpy(out)

    def blocks(self) -> RawBlocks:
        """The matrix as the file stores it (for a layer that runs its blocks; its pages released once converted)."""
        return RawBlocks.from_gguf(self.tensor.data, self.tensor.tensor_type.name, self.shape[1],
                                   lambda: self.reader.release(self.tensor), self.tensor.name)

    def release(self, start: int, stop: int) -> None:
        """Rows start .. stop have been read: unmap their pages."""
        row_bytes = self.tensor.data.nbytes // self.shape[0]
        self.reader.release(self.tensor, start * row_bytes, (stop - start) * row_bytes)

    def materialize(self, chunk: int = 4096) -> torch.Tensor:
        out = torch.empty(self.shape, dtype=torch.float32)
        for i in range(0, self.shape[0], chunk):
            out[i:i + chunk] = self[i:i + chunk]
        return out
