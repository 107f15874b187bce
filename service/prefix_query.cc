#include "service/prefix_query.h"

#include <cstring>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace attnd {

absl::StatusOr<std::vector<BlockHash>> ParseBlockHashes(
    const google::protobuf::RepeatedPtrField<std::string>& hashes, int64_t max,
    const std::string& field) {
  if (hashes.size() > max)
    return absl::InvalidArgumentError(
        absl::StrCat(field, ": ", hashes.size(), " block hashes, at most ", max));
  std::vector<BlockHash> out(static_cast<size_t>(hashes.size()));
  for (int i = 0; i < hashes.size(); ++i) {
    if (hashes[i].size() != out[i].size())
      return absl::InvalidArgumentError(
          absl::StrCat(field, "[", i, "]: ", hashes[i].size(), " bytes; a block hash is 32"));
    std::memcpy(out[i].data(), hashes[i].data(), out[i].size());
  }
  return out;
}

absl::StatusOr<PrefixQuery> ParsePrompt(
    const google::protobuf::RepeatedField<uint32_t>& token_ids,
    const google::protobuf::RepeatedPtrField<std::string>& block_hashes, const std::string& salt,
    const ModelSpec& spec, const std::string& tokens_field, const std::string& hashes_field) {
  const int64_t P = spec.page_size;
  if (token_ids.size() > spec.max_context)
    return absl::InvalidArgumentError(absl::StrCat(
        tokens_field, ": ", token_ids.size(), " tokens, at most max_context ", spec.max_context));
  if (salt.size() > kMaxPrefixSaltBytes)
    return absl::InvalidArgumentError(
        absl::StrCat("prefix_salt: ", salt.size(), " bytes, at most ", kMaxPrefixSaltBytes));
  if (!salt.empty() && token_ids.empty())
    return absl::InvalidArgumentError(absl::StrCat("prefix_salt: only with ", tokens_field,
                                                   " (block hashes already hold their salt)"));
  PrefixQuery q;
  ASSIGN_OR_RETURN(q.hashes, ParseBlockHashes(block_hashes, spec.max_context / P, hashes_field));
  if (token_ids.empty()) return q;
  const int64_t full = token_ids.size() / P * P;
  q.tokens.assign(token_ids.begin(), token_ids.begin() + full);
  std::vector<BlockHash> computed = HashBlocks(q.tokens, static_cast<int32_t>(P), salt);
  if (!q.hashes.empty() && q.hashes != computed)
    return absl::InvalidArgumentError(
        absl::StrCat(hashes_field, ": ", q.hashes.size(), " hashes that are not those of the ",
                     computed.size(), " full blocks of ", tokens_field, " (page size ", P, ")"));
  q.hashes = std::move(computed);
  q.max_blocks = (token_ids.size() - 1) / P;
  return q;
}

}  // namespace attnd
