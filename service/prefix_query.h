// A request's prompt for the prefix cache (docs/prefix_cache.md): OpenSequence and LookupPrefix
// give token ids (hashed here with the salt) or block hashes, and steps' entries the hashes of
// the blocks they complete. Every value is checked before it is used.
#pragma once

#include <string>

#include "absl/status/statusor.h"
#include "common/block_hash.h"
#include "common/model_spec.h"
#include "engine/engine.h"
#include "google/protobuf/repeated_field.h"

namespace attnd {

inline constexpr size_t kMaxPrefixSaltBytes = 256;

// The engine's query for a prompt: the hashes of its full blocks (computed from the token ids,
// or as given; both given must agree), the token ids of those blocks, and at most the blocks
// before the last token when token ids are given (the worker prefills that one for its logits).
// INVALID_ARGUMENT naming the field for more tokens or hashes than max_context holds, a hash
// that is not 32 bytes, a salt over 256 bytes or without token ids, and hashes that disagree.
// `tokens_field` and `hashes_field` name the request's fields in errors.
absl::StatusOr<PrefixQuery> ParsePrompt(
    const google::protobuf::RepeatedField<uint32_t>& token_ids,
    const google::protobuf::RepeatedPtrField<std::string>& block_hashes, const std::string& salt,
    const ModelSpec& spec, const std::string& tokens_field = "prompt_token_ids",
    const std::string& hashes_field = "prompt_block_hashes");

// Block hashes as given (each 32 bytes), at most `max` of them; `field` names them in errors.
absl::StatusOr<std::vector<BlockHash>> ParseBlockHashes(
    const google::protobuf::RepeatedPtrField<std::string>& hashes, int64_t max,
    const std::string& field);

}  // namespace attnd
