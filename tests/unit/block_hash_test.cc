// Prefix-cache block hashes: the C++ implementation against the vectors the Python one wrote
// (tests/data/block_hash_vectors.json, checked by client/python/tests/test_block_hash.py too), and
// the chain's properties: a block's hash names its whole prefix.
#include "common/block_hash.h"

#include <gtest/gtest.h>

#include <fstream>
#include <nlohmann/json.hpp>
#include <random>

#include "tests/random_tokens.h"

namespace attnd {
namespace {

using attnd::testing::RandomTokens;

TEST(BlockHash, MatchesTheVectorsThePythonClientChecks) {
  std::ifstream f(ATTND_SOURCE_DIR "/tests/data/block_hash_vectors.json");
  ASSERT_TRUE(f.good());
  const nlohmann::json doc = nlohmann::json::parse(f);
  ASSERT_GE(doc["cases"].size(), 5u);
  size_t blocks = 0;
  for (const auto& c : doc["cases"]) {
    const int32_t bs = c["block_size"];
    const std::string salt = c["salt"];
    const std::vector<uint32_t> tokens = c["tokens"].get<std::vector<uint32_t>>();
    EXPECT_EQ(BlockHashHex(PrefixRoot(bs, salt)), c["root"].get<std::string>());
    const std::vector<BlockHash> got = HashBlocks(tokens, bs, salt);
    ASSERT_EQ(got.size(), c["blocks"].size()) << "block size " << bs;
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_EQ(BlockHashHex(got[i]), c["blocks"][i].get<std::string>()) << bs << " " << i;
    blocks += got.size();
  }
  EXPECT_GE(blocks, 10u);
}

TEST(BlockHash, ABlocksHashNamesItsWholePrefix) {
  const std::vector<uint32_t> a = RandomTokens(64 * 6 + 10, 1);
  const std::vector<BlockHash> ha = HashBlocks(a, 64);
  ASSERT_EQ(ha.size(), 6u);  // the trailing 10 tokens are no block
  // One token changed in block 3: blocks 0-2 keep their hashes, 3 and every later one change.
  std::vector<uint32_t> b = a;
  b[3 * 64 + 17] ^= 1;
  const std::vector<BlockHash> hb = HashBlocks(b, 64);
  for (size_t i = 0; i < 6; ++i) EXPECT_EQ(ha[i] == hb[i], i < 3) << i;
  // The chain step by step equals HashBlocks.
  BlockHash parent = PrefixRoot(64);
  for (size_t i = 0; i < 6; ++i) {
    parent = HashBlock(parent, absl::MakeConstSpan(a).subspan(i * 64, 64));
    EXPECT_EQ(parent, ha[i]);
  }
  // Equal tokens at another block size or under another salt share nothing.
  EXPECT_NE(HashBlocks(a, 64, "lora:1")[0], ha[0]);
  EXPECT_NE(PrefixRoot(64), PrefixRoot(32));
  EXPECT_NE(PrefixRoot(64, "x"), PrefixRoot(64));
  // The same block after another parent differs (a block is its prefix, not its tokens).
  EXPECT_NE(HashBlock(ha[0], absl::MakeConstSpan(a).subspan(64, 64)),
            HashBlock(PrefixRoot(64), absl::MakeConstSpan(a).subspan(64, 64)));
  EXPECT_TRUE(HashBlocks(a, 0).empty());
  EXPECT_EQ(BlockHashHex(ha[0]).size(), 64u);
}

}  // namespace
}  // namespace attnd
