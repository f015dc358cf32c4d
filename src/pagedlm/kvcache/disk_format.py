"""The file format of the disk tier (disk_tier.py): one file holds a run of consecutive full KV blocks of one
prefix chain, named by the chain hash of its last block (which covers every token before it and the cache salt).

    MAGIC (8) | meta length (u32) | xxh3-128 of meta (16) | meta (JSON) | zero padding to PAGE | records

`meta` names the tier's namespace and identity (model, weights, KV dtype and layout, block size, format version),
the run's first block index, the chain hash, token ids and xxh3-128 digest of each block, and the record size
(format 1 had blake2b-128 digests: its files have another magic and namespace, and are never read).
A record is one block, layer-contiguous: [layers, 2 (K, V), block_size, kv_heads, entry_dim] of the cache's storage
dtype. A file whose header, identity, size or record digests do not check out is never used.
"""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

import xxhash

MAGIC = b"PLMKVR02"
FORMAT_VERSION = 2
PAGE = 4096
_PREFIX = struct.Struct("<8sI16s")
SUFFIX = ".kv"


class CorruptFileError(ValueError):
    """A file of the tier that is truncated, corrupted, or written for another identity."""


def digest(data: bytes | memoryview, size: int = 16) -> bytes:
    return hashlib.blake2b(data, digest_size=size).digest()


def record_digest(data: bytes | memoryview) -> bytes:
    """The checksum of a record or a header (not a name): xxh3-128, ~15x blake2b's rate."""
    return xxhash.xxh3_128_digest(data)


def namespace_of(identity: dict) -> str:
    """The hex digest naming everything that must match for a block to be reusable."""
    blob = json.dumps({**identity, "format": FORMAT_VERSION}, sort_keys=True).encode()
    return digest(blob, 16).hex()


def file_name(namespace: str, chain_hash: bytes) -> str:
    return digest(bytes.fromhex(namespace) + chain_hash, 20).hex() + SUFFIX


@dataclass
class RunHeader:
    """What a run file's header says (`data_offset`: where its first record starts)."""

    namespace: str
    identity: dict
    start: int  # block index of the first record in its chain
    record_bytes: int
    hashes: list[bytes]
    tokens: list[list[int]]
    digests: list[bytes]
    data_offset: int = 0

    @property
    def count(self) -> int:
        return len(self.hashes)

    def encode(self) -> bytes:
        meta = json.dumps({"namespace": self.namespace, "identity": self.identity, "start": self.start,
                           "record_bytes": self.record_bytes, "hashes": [h.hex() for h in self.hashes],
                           "tokens": self.tokens, "digests": [d.hex() for d in self.digests]},
                          sort_keys=True, separators=(",", ":")).encode()
        head = _PREFIX.pack(MAGIC, len(meta), record_digest(meta)) + meta
        return head + b"\0" * (-len(head) % PAGE)

    @classmethod
    def decode(cls, read, file_size: int) -> RunHeader:
        """Parse and check the header (`read(n)`: the file's next n bytes) against the file's size."""
        prefix = read(_PREFIX.size)
        if len(prefix) != _PREFIX.size:
            raise CorruptFileError("short header")
        magic, n, meta_digest = _PREFIX.unpack(prefix)
        if magic != MAGIC or n > file_size:
            raise CorruptFileError("not a KV run file")
        meta = read(n)
        if len(meta) != n or record_digest(meta) != meta_digest:
            raise CorruptFileError("header checksum mismatch")
        try:
            m = json.loads(meta)
            hdr = cls(m["namespace"], m["identity"], int(m["start"]), int(m["record_bytes"]),
                      [bytes.fromhex(h) for h in m["hashes"]], [list(map(int, t)) for t in m["tokens"]],
                      [bytes.fromhex(d) for d in m["digests"]])
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptFileError(f"bad header: {e}") from None
        hdr.data_offset = _PREFIX.size + n + (-(_PREFIX.size + n) % PAGE)
        if not (hdr.count and len(hdr.tokens) == len(hdr.digests) == hdr.count and hdr.record_bytes > 0):
            raise CorruptFileError("inconsistent header")
        if file_size != hdr.data_offset + hdr.count * hdr.record_bytes:
            raise CorruptFileError(f"size {file_size} does not match its {hdr.count} records (truncated?)")
        return hdr
