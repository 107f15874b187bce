// Prefix-cache block hashes (docs/prefix_cache.md): a block is one page of token ids; its hash
// chains its parent's hash with its tokens, so equal hashes mean equal prefixes. The function is
// fixed and the same in the server, the C++ client (this file) and the Python one
// (attnd/block_hash.py); tests/data/block_hash_vectors.json holds vectors both are checked
// against:
//   root  = SHA-256("attnd prefix v1" 0x00 || u32le(block_size) || salt)
//   block = SHA-256(parent || u32le(token_0) || ... || u32le(token_{block_size-1}))
// The first block's parent is the root; the salt separates caches whose keys differ for equal
// tokens (another model, a LoRA adapter, a different system of position ids): "" by default.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "absl/types/span.h"

namespace attnd {

using BlockHash = std::array<uint8_t, 32>;

// The chain's root for pages of `block_size` tokens under `salt`.
BlockHash PrefixRoot(int32_t block_size, std::string_view salt = {});

// One block's hash from its parent's (the root for the first block) and its token ids.
BlockHash HashBlock(const BlockHash& parent, absl::Span<const uint32_t> tokens);

// The hashes of every full block of `tokens` in order (a trailing partial block has none).
std::vector<BlockHash> HashBlocks(absl::Span<const uint32_t> tokens, int32_t block_size,
                                  std::string_view salt = {});

// Lower-case hex, 64 characters.
std::string BlockHashHex(const BlockHash& h);

}  // namespace attnd
