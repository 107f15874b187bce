// KV events between attnd's publisher (service/kv_events) and the C++ subscriber's decoder and
// index (client/kv_events): both of vLLM's forms, topics for any tenant name, numbers per topic.
// The decoders written from vLLM's and llm-d's own definitions are in
// client/python/tests/test_kv_events.py.
#include "client/kv_events.h"

#include <chrono>
#include <msgpack.hpp>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "gtest/gtest.h"
#include "service/kv_events.h"

namespace attnd {
namespace {

std::vector<PrefixEvent> SomeEvents(std::mt19937_64& rng) {
  auto hash = [&] {
    BlockHash h;
    for (auto& b : h) b = static_cast<uint8_t>(rng());
    return h;
  };
  PrefixEvent stored;
  stored.tenant = "t";
  stored.hashes = {hash(), hash()};
  stored.has_parent = true;
  stored.parent = hash();
  for (int i = 0; i < 8; ++i) stored.tokens.push_back(static_cast<uint32_t>(rng() % 150000));
  PrefixEvent first = stored;  // a prompt's first block: no parent, on the host tier
  first.has_parent = false;
  first.tier = Tier::kHost;
  PrefixEvent removed;
  removed.kind = PrefixEvent::Kind::kRemoved;
  removed.hashes = {hash()};
  removed.tier = Tier::kDisk;
  return {stored, first, removed};
}

TEST(KvEvents, BothFormsDecodeToTheSameEvents) {
  std::mt19937_64 rng(7);
  const std::vector<PrefixEvent> events = SomeEvents(rng);
  for (bool array_form : {false, true}) {
    KvEventsOptions o;
    o.block_size = 4;
    o.device_medium = {"GPU"};
    o.array_form = array_form;
    const std::string payload = EncodeKvEventBatch(12.5, events, 0, o, /*cleared=*/true);
    // The wire form itself: maps with "type" first, or arrays with the tag first.
    msgpack::object_handle oh = msgpack::unpack(payload.data(), payload.size());
    const msgpack::object& ev = oh.get().via.array.ptr[1].via.array.ptr[1];
    EXPECT_EQ(ev.type, array_form ? msgpack::type::ARRAY : msgpack::type::MAP);
    absl::StatusOr<client::KvEventBatch> b = client::DecodeKvEventBatch(payload);
    ASSERT_TRUE(b.ok()) << b.status();
    EXPECT_EQ(b->ts, 12.5);
    EXPECT_EQ(b->rank, 0);
    ASSERT_EQ(b->events.size(), 4u);
    EXPECT_EQ(b->events[0].kind, client::KvEvent::Kind::kCleared);
    for (size_t i = 0; i < events.size(); ++i) {
      const client::KvEvent& got = b->events[i + 1];
      EXPECT_EQ(got.hashes, events[i].hashes) << i;
      EXPECT_EQ(got.kind == client::KvEvent::Kind::kStored,
                events[i].kind == PrefixEvent::Kind::kStored);
    }
    EXPECT_EQ(b->events[1].parent, events[0].parent);
    EXPECT_FALSE(b->events[2].parent.has_value());
    EXPECT_EQ(b->events[1].tokens, events[0].tokens);
    EXPECT_EQ(b->events[1].block_size, 4);
    EXPECT_EQ(b->events[1].medium, "GPU");
    EXPECT_EQ(b->events[2].medium, "CPU");
    EXPECT_EQ(b->events[3].medium, array_form ? "DISK" : "STORAGE");
  }
}

TEST(KvEvents, TopicsSplitIntoThreePartsWhateverTheTenant) {
  for (const std::string tenant : {"", "plain", "a@b", "100%", "%40", "@@%%", "x@%25y"}) {
    const std::string topic = KvEventTopic("r-0", tenant);
    EXPECT_EQ(std::count(topic.begin(), topic.end(), '@'), 2) << topic;
    absl::StatusOr<std::pair<std::string, std::string>> back = client::ParseKvTopic(topic);
    ASSERT_TRUE(back.ok()) << back.status();
    EXPECT_EQ(back->first, "r-0");
    EXPECT_EQ(back->second, tenant) << topic;
  }
  for (const char* bad : {"metrics", "kv@r", "kv@r@a@b", "kv@r@%41", "kv@r@%4"})
    EXPECT_FALSE(client::ParseKvTopic(bad).ok()) << bad;
}

TEST(KvEvents, MalformedPayloadsAreRefused) {
  msgpack::sbuffer buf;
  msgpack::packer<msgpack::sbuffer> pk(buf);
  pk.pack_array(3);
  pk.pack_double(1);
  pk.pack_array(1);
  pk.pack_map(1);  // a map without "type"
  pk.pack(std::string("block_hashes"));
  pk.pack_array(0);
  pk.pack_nil();
  const std::string no_type(buf.data(), buf.size());
  for (const std::string& bad : {std::string("\xc1"), std::string("\x90"), no_type})
    EXPECT_EQ(client::DecodeKvEventBatch(bad).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(KvEvents, TheIndexCountsPerTopicAndAClearMakesAReplicaFreshAgain) {
  client::KvBlockIndex index;
  client::KvEventBatch stored;
  stored.rank = 0;
  client::KvEvent e;
  e.hashes = {BlockHash{1}};
  stored.events = {e};
  const uint64_t base = uint64_t{1} << 50;
  index.Apply("r", "a", base, stored);
  index.Apply("r", "b", base, stored);  // another tenant's topic counts on its own
  index.Apply("r", "a", base + 1, stored);
  EXPECT_FALSE(index.stale("r"));
  EXPECT_EQ(index.gaps(), 0);
  index.Apply("r", "b", base + 5, stored);  // b missed messages
  EXPECT_TRUE(index.stale("r"));
  EXPECT_EQ(index.CachedBlocks("r", "a", {BlockHash{1}}), std::nullopt);
  client::KvEventBatch cleared;
  client::KvEvent clear;
  clear.kind = client::KvEvent::Kind::kCleared;
  cleared.events = {clear};
  index.Apply("r", "", base + 9, cleared);  // a restart's announcement
  EXPECT_FALSE(index.stale("r"));
  EXPECT_EQ(index.CachedBlocks("r", "a", {BlockHash{1}}), 0);
  EXPECT_EQ(index.LastSeq("r", "b"), std::nullopt);
  index.Apply("r", "b", base + 100, stored);  // the new run's numbers: no gap after the clear
  EXPECT_FALSE(index.stale("r"));
  EXPECT_EQ(index.CachedBlocks("r", "b", {BlockHash{1}}), 1);
  EXPECT_EQ(index.LastSeq("r", "b"), base + 100);
}

// The C++ subscriber with a replay endpoint, against two runs of a publisher on the same
// endpoints: the second run's AllBlocksCleared goes out before the subscriber has reconnected,
// its first event's number jumps, and the replay brings the announcement.
TEST(KvEvents, TheSubscriberSeesARestartItMissedThroughTheReplay) {
  KvEventsOptions o;
  o.endpoint = "tcp://127.0.0.1:0";
  o.replay_endpoint = "tcp://127.0.0.1:0";
  o.replica = "r";
  o.block_size = 4;
  o.device_medium = {"CPU"};
  auto first = KvEventPublisher::Create(o);
  ASSERT_TRUE(first.ok()) << first.status();
  o.endpoint = (*first)->endpoint();  // the second run binds the same ports
  o.replay_endpoint = (*first)->replay_endpoint();
  auto sub = client::KvEventSubscriber::Start({{"r", o.endpoint}}, {{"r", o.replay_endpoint}});
  ASSERT_TRUE(sub.ok()) << sub.status();
  std::shared_ptr<client::KvBlockIndex> index = (*sub)->index();
  auto wait = [&](auto done) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!done() && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    return done();
  };
  std::this_thread::sleep_for(std::chrono::milliseconds(300));  // the subscription lands
  PrefixEvent a;
  a.tenant = "t";
  a.hashes = {BlockHash{1}};
  (*first)->Publish(a);
  ASSERT_TRUE(wait([&] { return index->CachedBlocks("r", "t", a.hashes) == 1; }));
  first->reset();
  auto second = KvEventPublisher::Create(o);
  ASSERT_TRUE(second.ok()) << second.status();
  std::this_thread::sleep_for(std::chrono::milliseconds(500));  // the subscriber reconnects
  PrefixEvent b = a;
  b.hashes = {BlockHash{2}};
  (*second)->Publish(b);
  ASSERT_TRUE(wait([&] { return index->CachedBlocks("r", "t", b.hashes) == 1; }));
  EXPECT_EQ(index->CachedBlocks("r", "t", a.hashes), 0) << "the first run's block is gone";
  EXPECT_FALSE(index->stale("r"));
  EXPECT_GE((*sub)->replayed(), 1);
  EXPECT_EQ((*sub)->errors(), 0);
}

}  // namespace
}  // namespace attnd
