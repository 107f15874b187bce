"""Prefix-cache block hashes: the Python implementation against the definition written out here
with hashlib and struct, and against tests/data/block_hash_vectors.json, which the C++ client's
implementation is checked against too (tests/unit/block_hash_test.cc)."""

import hashlib
import json
import pathlib
import struct

import numpy as np
import pytest

from attnd.block_hash import hash_block, hash_blocks, prefix_root

VECTORS = pathlib.Path(__file__).resolve().parents[3] / "tests" / "data" / "block_hash_vectors.json"


def by_definition(tokens, block_size, salt=b""):
    parent = hashlib.sha256(b"attnd prefix v1\x00" + struct.pack("<I", block_size) + salt).digest()
    out = []
    for b in range(len(tokens) // block_size):
        block = tokens[b * block_size:(b + 1) * block_size]
        parent = hashlib.sha256(parent + struct.pack(f"<{block_size}I", *block)).digest()
        out.append(parent)
    return out


def test_the_vectors_are_the_definition_and_this_implementation():
    doc = json.loads(VECTORS.read_text())
    assert len(doc["cases"]) >= 5
    for c in doc["cases"]:
        bs, salt, tokens = c["block_size"], c["salt"].encode(), c["tokens"]
        want = by_definition(tokens, bs, salt)
        assert [h.hex() for h in want] == c["blocks"]
        assert prefix_root(bs, salt).hex() == c["root"]
        assert hash_blocks(tokens, bs, salt) == want
        assert hash_blocks(np.asarray(tokens, dtype=np.int64), bs, salt) == want  # any int array


def test_a_blocks_hash_names_its_whole_prefix():
    rng = np.random.default_rng(3)
    a = rng.integers(0, 129280, 64 * 5 + 7)
    ha = hash_blocks(a, 64)
    assert len(ha) == 5 and all(len(h) == 32 for h in ha)
    b = a.copy()
    b[2 * 64 + 5] += 1
    hb = hash_blocks(b, 64)
    assert [x == y for x, y in zip(ha, hb)] == [True, True, False, False, False]
    assert hash_block(prefix_root(64), a[:64]) == ha[0]
    assert hash_block(ha[0], a[64:128]) == ha[1]
    assert hash_blocks(a, 64, "lora:1")[0] != ha[0]
    assert hash_blocks(a[:63], 64) == []


@pytest.mark.parametrize("tokens", [[-1], [2**32], [[1, 2]], [1.5]])
def test_token_ids_outside_u32_are_refused(tokens):
    with pytest.raises(ValueError):
        hash_blocks(tokens, 1)


def test_a_bad_block_size_or_parent_is_refused():
    with pytest.raises(ValueError):
        prefix_root(0)
    with pytest.raises(ValueError):
        hash_block(b"short", [1])
