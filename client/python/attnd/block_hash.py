"""Prefix-cache block hashes (docs/prefix_cache.md), the same function as the server's and the C++
client's (common/block_hash.h): a block is one page of token ids; its hash chains its parent's
hash with its tokens, so equal hashes mean equal prefixes.

    root  = SHA-256(b"attnd prefix v1\\x00" + u32le(block_size) + salt)
    block = SHA-256(parent + u32le(token_0) + ... + u32le(token_{block_size-1}))

Hashes are 32-byte ``bytes`` (vLLM's KV events carry them as they are).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

import numpy as np

_DOMAIN = b"attnd prefix v1\x00"


def prefix_root(block_size: int, salt: bytes | str = b"") -> bytes:
    """The chain's root for pages of ``block_size`` tokens under ``salt``."""
    if isinstance(salt, str):
        salt = salt.encode()
    if not 0 < block_size < 2**32:
        raise ValueError(f"block_size {block_size}: must be in [1, 2^32)")
    return hashlib.sha256(_DOMAIN + struct.pack("<I", block_size) + salt).digest()


def _token_bytes(tokens: Sequence[int] | np.ndarray) -> bytes:
    a = np.asarray(tokens)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise ValueError("token ids: a 1-D sequence of integers")
    if a.size and (int(a.min()) < 0 or int(a.max()) >= 2**32):
        raise ValueError("token ids must be in [0, 2^32)")
    return a.astype("<u4").tobytes()


def hash_block(parent: bytes, tokens: Sequence[int] | np.ndarray) -> bytes:
    """One block's hash from its parent's (the root for the first block) and its token ids."""
    if len(parent) != 32:
        raise ValueError(f"parent hash: 32 bytes, got {len(parent)}")
    return hashlib.sha256(bytes(parent) + _token_bytes(tokens)).digest()


def hash_blocks(tokens: Sequence[int] | np.ndarray, block_size: int,
                salt: bytes | str = b"") -> list[bytes]:
    """The hashes of every full block of ``tokens`` in order (a trailing partial block has none)."""
    data = _token_bytes(tokens)
    parent = prefix_root(block_size, salt)
    out = []
    step = 4 * block_size
    for b in range(0, len(data) - step + 1, step):
        parent = hashlib.sha256(parent + data[b:b + step]).digest()
        out.append(parent)
    return out
