// Random token ids for the prefix-cache tests and benchmarks: n ids below `vocab` (DeepSeek-V3's
// vocabulary by default), from a seed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <random>
#include <vector>

namespace attnd::testing {

inline std::vector<uint32_t> RandomTokens(size_t n, uint64_t seed, uint32_t vocab = 129280) {
  std::mt19937_64 rng(seed);
  std::vector<uint32_t> t(n);
  for (uint32_t& x : t) x = static_cast<uint32_t>(rng() % vocab);
  return t;
}

}  // namespace attnd::testing
