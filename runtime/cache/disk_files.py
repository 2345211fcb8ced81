"""The disk tier's block files: names, header, checksums (no threads, no budget, no index).

A file is ``<group>_<depth>_<key>.kvb`` (group "" or 16 hex digits; ``<key>.kvb`` as written
before groups, depth 0) holding a header (magic, key, payload bytes, sha256 of the payload) and
the block's raw bytes. A file whose header or checksum does not match is not a block
(``decode_block`` returns None). ``runtime.cache.disk_tier`` owns the directory.
"""

from __future__ import annotations

import hashlib
import struct
from pathlib import Path

import torch

__all__ = [
    "DISK_HEADER_BYTES",
    "block_file_name",
    "decode_block",
    "encode_block",
    "list_block_files",
]

_MAGIC = b"ACKVBLK1"
_HEADER = struct.Struct("<8s32sQ32s")  # magic, key, payload bytes, sha256(payload)
_SUFFIX = ".kvb"
DISK_HEADER_BYTES = _HEADER.size
"""Bytes each block file adds to its payload (size a budget as blocks * (block_bytes + this))."""


def block_file_name(key: str, group: str, depth: int) -> str:
    """The file name of block ``key`` (64 hex digits) in ``group`` at chain ``depth``."""
    return f"{group}_{depth}_{key}{_SUFFIX}"


def list_block_files(path: Path) -> list[tuple[Path, str, str, int]]:
    """``(path, key, group, depth)`` of every block file in folder ``path`` (others skipped)."""
    out = []
    for p in path.iterdir():
        parts = p.stem.split("_")
        if p.suffix != _SUFFIX or len(parts[-1]) != 64:
            continue
        if len(parts) == 1:
            out.append((p, parts[0], "", 0))
        elif len(parts) == 3 and len(parts[0]) in (0, 16) and parts[1].isdigit():
            out.append((p, parts[2], parts[0], int(parts[1])))
    return out


def encode_block(key: str, block: torch.Tensor) -> tuple[bytes, bytes]:
    """``(header, payload)`` of block ``key``: its raw bytes and their sha256."""
    payload = block.contiguous().view(torch.uint8).numpy().tobytes()
    digest = hashlib.sha256(payload).digest()
    return _HEADER.pack(_MAGIC, bytes.fromhex(key), len(payload), digest), payload


def decode_block(
    key: str, data: bytes, shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor | None:
    """Block ``key`` of ``shape`` / ``dtype`` from a file's bytes, or None when the file is
    damaged, truncated, of another key, shape or dtype."""
    if len(data) < _HEADER.size:
        return None
    magic, stored_key, size, digest = _HEADER.unpack_from(data)
    payload = memoryview(data)[_HEADER.size :]
    expected = _numel(shape) * torch.empty((), dtype=dtype).element_size()
    if magic != _MAGIC or stored_key != bytes.fromhex(key) or size != len(payload):
        return None
    if size != expected or hashlib.sha256(payload).digest() != digest:
        return None
    flat = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    return flat.view(dtype).view(shape)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for dim in shape:
        n *= dim
    return n
