// The prefix cache through the engine (docs/prefix_cache.md): a sequence opened on cached blocks
// gives outputs bit for bit those of the same sequence prefilled cold (fp32, bf16 and fp8
// caches, through decode, and after its blocks went down a tier and came back); blocks outlive
// every sequence that used them until evicted; eviction under pressure never takes a block an
// open sequence uses; tenants never see each other's blocks; malformed or mismatched hashes are
// refused with nothing changed; --prefix-cache-bytes bounds what closed sequences leave; the
// events replay to the index's exact block set. Every state is audited (CheckInvariants).
#include <gtest/gtest.h>

#include <random>
#include <set>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/block_hash.h"
#include "kv_store/host_tier.h"
#include "tests/engine_harness.h"
#include "tests/random_tokens.h"
#include "tests/run_layer.h"

namespace attnd::testing {
namespace {

std::vector<uint32_t> Tokens(size_t n, uint64_t seed) { return RandomTokens(n, seed, 150000); }

// The engine's query for a prompt (as the service makes it from token ids): its full blocks'
// hashes and tokens, at most the blocks before its last token.
PrefixQuery Prompt(const std::vector<uint32_t>& tokens, int32_t P) {
  PrefixQuery q;
  q.tokens.assign(tokens.begin(), tokens.begin() + tokens.size() / P * P);
  q.hashes = HashBlocks(q.tokens, P);
  q.max_blocks = (static_cast<int64_t>(tokens.size()) - 1) / P;
  return q;
}

EngineOptions Options(DType cache, int32_t usable, int64_t prefix_bytes = -1) {
  EngineOptions o = TestEngineOptions(MixedLayerSpec(SelectionMode::kToken), usable + 1, cache);
  o.prefix_cache_bytes = prefix_bytes;
  return o;
}

DType RequestDType(DType cache) { return cache == DType::kF32 ? DType::kF32 : DType::kBF16; }

// Whether a step of q new tokens on `id`, with random `dtype` inputs from `seed`, commits.
bool Commits(Harness& h, const std::string& id, int64_t q, DType dtype, uint64_t seed) {
  return h.Run({{id, q}}, h.MakeInputs({{id, q}}, dtype, seed)).status.ok();
}

void ExpectAudited(Engine& e) {
  const absl::Status s = e.CheckInvariants();
  EXPECT_TRUE(s.ok()) << s;
}

void ExpectSame(const Harness::Result& a, const Harness::Result& b) {  // bit for bit
  ASSERT_TRUE(a.status.ok()) << a.status;
  ASSERT_TRUE(b.status.ok()) << b.status;
  for (size_t l = 0; l < a.out.size(); ++l) {
    ASSERT_EQ(a.out[l], b.out[l]) << "layer " << l << ": the bits differ from the cold prefill";
    ASSERT_EQ(a.lse[l], b.lse[l]) << "layer " << l;
    ASSERT_EQ(a.traces[l].keys, b.traces[l].keys) << "layer " << l;
  }
}

class PrefixCacheExact : public ::testing::TestWithParam<DType> {};

// Warm: A prefills the prompt's first 2 blocks (32 tokens) and a partial block, then closes; B,
// whose prompt starts with the same 2 blocks, opens on them and prefills only the rest. Cold:
// B prefilled from nothing with the same keys. B's steps agree bit for bit, and with float64.
TEST_P(PrefixCacheExact, ASequenceOpenedOnCachedBlocksDecodesBitForBitAsOnePrefilledCold) {
  const DType cache = GetParam();
  const DType dt = RequestDType(cache);
  Harness warm(Options(cache, 32)), cold(Options(cache, 32));
  const int32_t P = warm.spec().page_size;
  const std::vector<uint32_t> shared = Tokens(2 * P, 1);
  std::vector<uint32_t> a_prompt = shared, b_prompt = shared;
  for (uint32_t t : Tokens(P / 2, 2)) a_prompt.push_back(t);
  for (uint32_t t : Tokens(P + 5, 3)) b_prompt.push_back(t);

  ASSERT_EQ(warm.OpenCached("A", Prompt(a_prompt, P), ""), 0);  // nothing cached yet
  const auto prefix = warm.MakeInputs({{"A", 2 * P}}, dt, 11);
  ASSERT_TRUE(warm.Run({{"A", 2 * P}}, prefix).status.ok());
  ASSERT_TRUE(Commits(warm, "A", P / 2, dt, 12));
  ASSERT_TRUE(warm.engine().CloseSequence("A").ok());  // the reference keeps A's history
  EXPECT_EQ(warm.engine().PrefixCacheStats().cached_only, 2);
  ExpectAudited(warm.engine());

  ASSERT_EQ(warm.OpenCached("B", Prompt(b_prompt, P), "A"), 2 * P);
  cold.Open("B");
  ASSERT_TRUE(cold.Run({{"B", 2 * P}}, prefix).status.ok());
  uint64_t seed = 100;
  const int64_t rest = static_cast<int64_t>(b_prompt.size()) - 2 * P;
  for (const int64_t q : {rest, int64_t{1}, int64_t{1}, int64_t{1}}) {
    ++seed;
    // Warm against float64 (RunAndCheck), then the same inputs cold: the same bits.
    const auto a = warm.RunAndCheck({{"B", q}}, dt, seed, cache == DType::kF32 ? 1e-5 : 1e-2);
    const auto b = cold.Run({{"B", q}}, cold.MakeInputs({{"B", q}}, dt, seed));
    ASSERT_TRUE(b.status.ok()) << b.status;
    ASSERT_EQ(a.size(), b.out.size());
    for (size_t l = 0; l < a.size(); ++l)
      ASSERT_EQ(a[l], b.out[l]) << "layer " << l << ": the bits differ from the cold prefill";
    ExpectAudited(warm.engine());
  }
  EXPECT_EQ(warm.engine().PrefixCacheStats().hit_blocks, 2);
}

INSTANTIATE_TEST_SUITE_P(Caches, PrefixCacheExact,
                         ::testing::Values(DType::kF32, DType::kBF16, DType::kFP8E4M3),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

// Blocks are shared exactly like a fork's full pages and outlive every sequence that used them;
// blocks completed by decode steps (hashes in the step's entries) become findable too.
TEST(PrefixCache, SharedBlocksSurviveTheCloseOfEverySequenceThatUsedThem) {
  Harness h(Options(DType::kF32, 32));
  Engine& e = h.engine();
  const int32_t P = h.spec().page_size;
  const std::vector<uint32_t> prompt = Tokens(2 * P + 3, 5);
  h.OpenCached("A", Prompt(prompt, P), "");
  ASSERT_TRUE(Commits(h, "A", 2 * P + 3, DType::kF32, 1));
  EXPECT_EQ(e.LookupPrefix("", HashBlocks(prompt, P)).blocks, 2);
  ASSERT_EQ(h.OpenCached("B", Prompt(prompt, P), "A"), 2 * P);  // while A is open
  const auto a = *e.DescribeSequence("A");
  const auto b = *e.DescribeSequence("B");
  EXPECT_EQ(std::vector<int32_t>(a.pages.begin(), a.pages.begin() + 2), b.pages);
  EXPECT_EQ(e.PageRefcounts(0)[b.pages[0]], 3);  // A, B and the cache
  // A decode step completes A's third block: its hash comes with the entry.
  std::vector<uint32_t> more = prompt;
  for (uint32_t t : Tokens(P - 3, 6)) more.push_back(t);
  const std::vector<BlockHash> all = HashBlocks(more, P);
  StepEntry fill{"A", P - 3};
  fill.block_hashes = {all[2]};
  ASSERT_TRUE(h.Run({fill}, h.MakeInputs({fill}, DType::kF32, 2)).status.ok());
  EXPECT_EQ(e.LookupPrefix("", all).blocks, 3);
  h.Close("B");
  ASSERT_TRUE(e.CloseSequence("A").ok());
  ExpectAudited(e);
  EXPECT_EQ(e.PrefixCacheStats().blocks, 3);
  EXPECT_EQ(e.PrefixCacheStats().cached_only, 3);
  EXPECT_EQ(e.Capacity()[0].pages_cached, 3);
  EXPECT_EQ(e.PageRefcounts(0)[b.pages[0]], 1);  // the cache alone
  std::vector<uint32_t> longer = more;
  for (uint32_t t : Tokens(5, 7)) longer.push_back(t);
  EXPECT_EQ(h.OpenCached("C", Prompt(longer, P), "A"), 3 * P);
  ExpectAudited(e);
}

// A device of 8 pages: cached blocks of closed sequences make way for steps; blocks an open
// sequence holds never do (they are not the cache's alone), and a step that needs more than the
// free and cache-only pages is refused with nothing changed.
TEST(PrefixCache, EvictionUnderPressureNeverTakesABlockAnOpenSequenceUses) {
  Harness h(Options(DType::kF32, 8));
  Engine& e = h.engine();
  const int32_t P = h.spec().page_size;
  const std::vector<uint32_t> kept = Tokens(2 * P + 1, 8), gone = Tokens(2 * P + 1, 9);
  h.OpenCached("A", Prompt(kept, P), "");
  ASSERT_TRUE(Commits(h, "A", 2 * P, DType::kF32, 1));
  ASSERT_EQ(h.OpenCached("B", Prompt(kept, P), "A"), 2 * P);
  ASSERT_TRUE(e.CloseSequence("A").ok());  // B holds the blocks now
  h.OpenCached("C", Prompt(gone, P), "");
  ASSERT_TRUE(Commits(h, "C", 2 * P, DType::kF32, 2));
  ASSERT_TRUE(e.CloseSequence("C").ok());
  EXPECT_EQ(e.PrefixCacheStats().cached_only, 2);  // C's blocks; A's are B's too
  EXPECT_EQ(e.Capacity()[0].pages_free, 4);
  // 6 pages: the 4 free and C's 2 cached ones.
  h.Open("D");
  ASSERT_TRUE(Commits(h, "D", 6 * P, DType::kF32, 3));
  ExpectAudited(e);
  EXPECT_EQ(e.LookupPrefix("", HashBlocks(gone, P)).blocks, 0);
  EXPECT_EQ(e.LookupPrefix("", HashBlocks(kept, P)).blocks, 2);
  // Nothing left to take: B's blocks stay, the step is refused and changes nothing.
  const EngineSnapshot before = TakeSnapshot(e, {"B", "D"});
  const auto refused = h.Run({{"D", 1}}, h.MakeInputs({{"D", 1}}, DType::kF32, 4));
  EXPECT_EQ(refused.status.code(), absl::StatusCode::kResourceExhausted) << refused.status;
  EXPECT_TRUE(before == TakeSnapshot(e, {"B", "D"}));
  // B still decodes on its cached blocks, exactly (float64).
  h.Close("D");
  h.RunAndCheck({{"B", 1}}, DType::kF32, 5, 1e-5);
  ExpectAudited(e);
}

// A write-only step of `q` tokens on `tenant`'s sequence `id` (the harness's steps are the
// anonymous tenant's).
void WriteKeys(Harness& h, const std::string& tenant, const std::string& id, int64_t q) {
  StepOptions o = StepOptions::WriteOnly();
  o.tenant = tenant;
  auto step = h.engine().BeginStep({{id, q}}, o);
  ASSERT_TRUE(step.ok()) << step.status();
  const auto keys = h.MakeKeys({{id, q}}, DType::kF32, 1);
  for (int l = 0; l < h.spec().num_layers(); ++l) {
    LayerInputs in;
    in.kv_latent = keys[l].kv_latent.view();
    in.k_rope = keys[l].k_rope.view();
    in.index_k = keys[l].index_k.view();
    ASSERT_TRUE(RunLayerInto(h.engine(), StepRef(tenant, *step), l, in, nullptr, 0).ok());
  }
}

TEST(PrefixCache, TenantsNeverSeeEachOthersBlocks) {
  Harness h(Options(DType::kF32, 32));
  Engine& e = h.engine();
  const int32_t P = h.spec().page_size;
  const std::vector<uint32_t> prompt = Tokens(2 * P + 1, 10);
  const SequenceKey x("tenant-x", "s"), y("tenant-y", "s");
  ASSERT_TRUE(e.OpenSequence(x, -1, Prompt(prompt, P)).ok());
  WriteKeys(h, "tenant-x", "s", 2 * P);
  EXPECT_EQ(e.LookupPrefix("tenant-x", HashBlocks(prompt, P)).blocks, 2);
  EXPECT_EQ(e.LookupPrefix("tenant-y", HashBlocks(prompt, P)).blocks, 0);
  EXPECT_EQ(e.LookupPrefix("", HashBlocks(prompt, P)).blocks, 0);
  auto cached = e.OpenSequence(y, -1, Prompt(prompt, P));
  ASSERT_TRUE(cached.ok()) << cached.status();
  EXPECT_EQ(*cached, 0);
  EXPECT_EQ(e.DescribeSequence(y)->length, 0);
  ASSERT_TRUE(e.CloseSequence(x).ok());
  auto again = e.OpenSequence(SequenceKey("tenant-x", "t"), -1, Prompt(prompt, P));
  ASSERT_TRUE(again.ok());
  EXPECT_EQ(*again, 2 * P);
  ExpectAudited(e);
}

TEST(PrefixCache, MalformedOrMismatchedHashesAreRefusedWithNothingChanged) {
  Harness h(Options(DType::kF32, 32));
  Engine& e = h.engine();
  const int32_t P = h.spec().page_size;
  const std::vector<uint32_t> prompt = Tokens(2 * P + 1, 11);
  h.OpenCached("A", Prompt(prompt, P), "");
  h.Open("plain");
  ASSERT_TRUE(Commits(h, "plain", P, DType::kF32, 1));
  const EngineSnapshot before = TakeSnapshot(e, {"A", "plain"});
  auto refused = [&](std::vector<StepEntry> batch, const char* why) {
    const auto r = h.Run(batch, h.MakeInputs(batch, DType::kF32, 2));
    EXPECT_EQ(r.status.code(), absl::StatusCode::kInvalidArgument) << r.status;
    EXPECT_NE(r.status.message().find(why), std::string::npos) << r.status;
    EXPECT_TRUE(before == TakeSnapshot(e, {"A", "plain"}));
  };
  const std::vector<BlockHash> hashes = HashBlocks(prompt, P);
  StepEntry one{"A", 2 * P};
  one.block_hashes = {hashes[0]};  // two blocks complete
  refused({one}, "1 block hashes for the 2 blocks");
  StepEntry wrong{"A", 2 * P};
  wrong.block_hashes = {hashes[0], hashes[0]};  // the prompt says otherwise
  refused({wrong}, "differs from its prompt's");
  StepEntry blind{"plain", P};  // its first block was committed without a hash
  blind.block_hashes = {hashes[1]};
  refused({blind}, "only 0 of the 1 before them have hashes");
  StepEntry fine{"A", 2 * P};
  fine.block_hashes = {hashes[0], hashes[1]};
  refused({fine, blind}, "only 0 of the 1");  // one bad entry refuses the whole batch
  PrefixQuery too_many;
  too_many.hashes.resize(h.spec().max_context / P + 1);
  EXPECT_EQ(e.OpenSequence("X", -1, too_many).status().code(), absl::StatusCode::kInvalidArgument);
  PrefixQuery torn = Prompt(prompt, P);
  torn.tokens.pop_back();
  EXPECT_EQ(e.OpenSequence("X", -1, torn).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(e.DescribeSequence("X").status().code(), absl::StatusCode::kNotFound);
  ExpectAudited(e);
}

// --prefix-cache-bytes bounds the pages closed sequences leave, the least recently used blocks
// (a chain's last block first) going out.
TEST(PrefixCache, PrefixCacheBytesBoundsWhatClosedSequencesLeave) {
  const size_t page =
      CacheLayout::ForModel(MixedLayerSpec(SelectionMode::kToken), DType::kF32, 33).BytesPerPage();
  Harness h(Options(DType::kF32, 32, static_cast<int64_t>(3 * page)));
  Engine& e = h.engine();
  const int32_t P = h.spec().page_size;
  const std::vector<uint32_t> p1 = Tokens(2 * P + 1, 12), p2 = Tokens(2 * P + 1, 13);
  for (const auto& [id, prompt] : {std::pair{"A", p1}, std::pair{"B", p2}}) {
    h.OpenCached(id, Prompt(prompt, P), "");
    ASSERT_TRUE(Commits(h, id, 2 * P, DType::kF32, 1));
  }
  h.Close("A");
  EXPECT_EQ(e.PrefixCacheStats().cached_only, 2);
  h.Close("B");
  EXPECT_EQ(e.PrefixCacheStats().cached_only, 3);
  EXPECT_EQ(e.LookupPrefix("", HashBlocks(p1, P)).blocks, 1);  // A's last block went first
  EXPECT_EQ(e.LookupPrefix("", HashBlocks(p2, P)).blocks, 2);
  ExpectAudited(e);
}

// Every block stored and removed is heard: replaying the events gives the index's block set.
TEST(PrefixCache, EventsReplayToTheExactBlockSet) {
  std::set<std::pair<int, std::string>> replay;  // (device, hash)
  int stored = 0, removed = 0;
  EngineOptions o = Options(DType::kF32, 8);
  o.on_prefix_event = [&](const PrefixEvent& ev) {
    for (const BlockHash& hsh : ev.hashes) {
      const auto key = std::pair{ev.device, BlockHashHex(hsh)};
      if (ev.kind == PrefixEvent::Kind::kStored) {
        EXPECT_TRUE(replay.insert(key).second) << "stored twice";
        ++stored;
      } else {
        EXPECT_EQ(replay.erase(key), 1u) << "removed but never stored";
        ++removed;
      }
    }
  };
  Harness h(std::move(o));
  Engine& e = h.engine();
  const int32_t P = h.spec().page_size;
  for (int i = 0; i < 4; ++i) {
    const std::string id = absl::StrCat("s", i);
    h.OpenCached(id, Prompt(Tokens(3 * P + 1, 20 + i), P), "");
    ASSERT_TRUE(Commits(h, id, 3 * P, DType::kF32, i));
    h.Close(id);  // 3 blocks each on 8 pages: older ones make way
  }
  EXPECT_GT(removed, 0);
  std::set<std::pair<int, std::string>> index;
  for (int i = 0; i < 4; ++i) {
    const auto hashes = HashBlocks(Tokens(3 * P + 1, 20 + i), P);
    const PrefixLookup found = e.LookupPrefix("", hashes);
    for (int64_t b = 0; b < found.blocks; ++b)
      index.insert({found.device, BlockHashHex(hashes[b])});
  }
  EXPECT_EQ(replay, index);
  EXPECT_EQ(stored - removed, e.PrefixCacheStats().blocks);
  ExpectAudited(e);
}

// With a host tier below, closed sequences' blocks go down instead of away when the device needs
// room, and a sequence opened on them is restored by its first step, bit for bit.
TEST(PrefixCache, CachedBlocksGoDownATierAndComeBackBitForBit) {
  EngineOptions small = Options(DType::kBF16, 6);
  const size_t page = TierStride(CacheLayout::ForModel(small.spec, DType::kBF16, 7).BytesPerPage());
  small.tiers.host_bytes = 8 * page;
  Harness warm(std::move(small)), cold(Options(DType::kBF16, 32));
  Engine& e = warm.engine();
  const int32_t P = warm.spec().page_size;
  const std::vector<uint32_t> prompt = Tokens(2 * P + 1, 30);
  warm.OpenCached("A", Prompt(prompt, P), "");
  const auto prefix = warm.MakeInputs({{"A", 2 * P}}, DType::kBF16, 1);
  ASSERT_TRUE(warm.Run({{"A", 2 * P}}, prefix).status.ok());
  ASSERT_TRUE(e.CloseSequence("A").ok());
  warm.Open("big");  // needs the whole device: A's blocks go to the host
  ASSERT_TRUE(Commits(warm, "big", 6 * P, DType::kBF16, 2));
  ExpectAudited(e);
  const PrefixLookup below = e.LookupPrefix("", HashBlocks(prompt, P));
  EXPECT_EQ(below.blocks, 2);
  EXPECT_EQ(below.on_device, 0);
  ASSERT_EQ(warm.OpenCached("B", Prompt(prompt, P), "A"), 2 * P);
  EXPECT_EQ(e.DescribeSequence("B")->tier, Tier::kHost);
  cold.Open("B");
  ASSERT_TRUE(cold.Run({{"B", 2 * P}}, prefix).status.ok());
  for (const int64_t q : {int64_t{1}, int64_t{1}}) {
    const auto in = warm.MakeInputs({{"B", q}}, DType::kBF16, 10 + q);
    ExpectSame(warm.Run({{"B", q}}, in), cold.Run({{"B", q}}, in));  // "big" spills for room
    ExpectAudited(e);
  }
}

}  // namespace
}  // namespace attnd::testing
