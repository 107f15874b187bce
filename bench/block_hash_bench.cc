// Prefix-cache block hashes (common/block_hash.h) against the SHA-256 rate of this machine on
// the same bytes in one digest (the peer: what hashing the tokens costs at all), and the time per
// 64-token block. The ratio is the chain's per-block overhead (a digest per block, its 32-byte
// parent, the little-endian packing).
//   build/bench/block_hash_bench --benchmark_repetitions=3
#include <benchmark/benchmark.h>
#include <openssl/evp.h>

#include <random>
#include <vector>

#include "common/block_hash.h"
#include "tests/random_tokens.h"

namespace {

std::vector<uint32_t> Tokens(size_t n) { return attnd::testing::RandomTokens(n, 1); }

// A 32K-token prompt at page size 64: 512 blocks.
void BM_HashBlocks(benchmark::State& state) {
  const std::vector<uint32_t> t = Tokens(32768);
  for (auto _ : state) benchmark::DoNotOptimize(attnd::HashBlocks(t, 64));
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(t.size() * 4));
  state.counters["us_per_block"] = benchmark::Counter(
      double(state.iterations()) * 512, benchmark::Counter::kIsRate | benchmark::Counter::kInvert,
      benchmark::Counter::kIs1000);
}
BENCHMARK(BM_HashBlocks)->Unit(benchmark::kMicrosecond);

// The peer: SHA-256 of the same 128 KiB in one digest.
void BM_Sha256OneDigest(benchmark::State& state) {
  const std::vector<uint32_t> t = Tokens(32768);
  EVP_MD_CTX* ctx = EVP_MD_CTX_new();
  unsigned char out[32];
  unsigned int n = 0;
  for (auto _ : state) {
    EVP_DigestInit_ex(ctx, EVP_sha256(), nullptr);
    EVP_DigestUpdate(ctx, t.data(), t.size() * 4);
    EVP_DigestFinal_ex(ctx, out, &n);
    benchmark::DoNotOptimize(out);
  }
  EVP_MD_CTX_free(ctx);
  state.SetBytesProcessed(int64_t(state.iterations()) * int64_t(t.size() * 4));
}
BENCHMARK(BM_Sha256OneDigest)->Unit(benchmark::kMicrosecond);

}  // namespace

BENCHMARK_MAIN();
