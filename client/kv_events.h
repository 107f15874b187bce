// KV events for C++ routers (docs/prefix_cache.md#kv-events): decode what attnd --kv-events
// publishes (vLLM's KV-event schema: msgpack EventBatch [ts, events, data_parallel_rank] in the
// third frame of "kv@<replica>@<tenant>", seq, payload), replay it into what each replica's prefix
// cache holds (KvBlockIndex, a client::PrefixView for Router::ChooseByPrefix), and follow a set of
// replicas over ZeroMQ in a thread (KvEventSubscriber). The library attnd_kv_events (libzmq,
// msgpack-c); the Python twin is attnd.kv_events.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "client/router.h"
#include "common/block_hash.h"

namespace attnd::client {

struct KvEvent {
  enum class Kind { kStored, kRemoved, kCleared };
  Kind kind = Kind::kStored;
  std::vector<BlockHash> hashes;
  std::optional<BlockHash> parent;  // stored: the block before the first
  std::vector<uint32_t> tokens;     // stored: the blocks' token ids (may be empty)
  int64_t block_size = 0;
  std::string medium;
};

struct KvEventBatch {
  double ts = 0;
  std::vector<KvEvent> events;
  std::optional<int64_t> rank;  // attnd: the device index
};

// One payload; INVALID_ARGUMENT for anything that is not an EventBatch of known events.
absl::StatusOr<KvEventBatch> DecodeKvEventBatch(const std::string& payload);
// "kv@<replica>@<tenant>" -> (replica, tenant); INVALID_ARGUMENT otherwise.
absl::StatusOr<std::pair<std::string, std::string>> ParseKvTopic(const std::string& topic);

// What each replica's prefix cache holds, replayed from its events: per (replica, tenant), block
// hash -> devices. Numbers are counted per topic: a gap in one makes its replica stale
// (CachedBlocks says nothing: ask the replica); a number counting back (a restart) or
// AllBlocksCleared empties the replica's view and makes it fresh again.
// Thread safe.
class KvBlockIndex : public PrefixView {
 public:
  void Apply(const std::string& replica, const std::string& tenant, uint64_t seq,
             const KvEventBatch& batch);
  std::optional<int64_t> CachedBlocks(const std::string& replica, const std::string& tenant,
                                      const std::vector<BlockHash>& hashes) const override;
  bool stale(const std::string& replica) const;
  int64_t gaps() const;
  int64_t restarts() const;
  size_t blocks(const std::string& replica, const std::string& tenant) const;
  // The last number applied on (replica, tenant)'s topic; none before its first or after a clear.
  std::optional<uint64_t> LastSeq(const std::string& replica, const std::string& tenant) const;

 private:
  void ClearLocked(const std::string& replica);
  mutable std::mutex mu_;
  std::map<std::pair<std::string, std::string>, std::map<BlockHash, std::set<int64_t>>> blocks_;
  std::map<std::pair<std::string, std::string>, uint64_t> last_seq_;  // per topic
  std::set<std::string> stale_;
  int64_t gaps_ = 0, restarts_ = 0;
};

// Follows replicas' KV events ({name: "tcp://host:port"}) in a thread into index(). With a
// replica's replay endpoint (attnd --kv-events-replay), a gap in a topic's numbers is filled from
// the replica's buffer before the message that showed it is applied (what the buffer no longer
// has leaves the replica stale, as without replay).
class KvEventSubscriber {
 public:
  // INVALID_ARGUMENT when an endpoint cannot be connected to.
  static absl::StatusOr<std::unique_ptr<KvEventSubscriber>> Start(
      const std::map<std::string, std::string>& endpoints,
      const std::map<std::string, std::string>& replay = {});
  ~KvEventSubscriber();
  std::shared_ptr<KvBlockIndex> index() const { return index_; }
  int64_t messages() const { return messages_.load(); }
  int64_t errors() const { return errors_.load(); }
  int64_t replayed() const { return replayed_.load(); }

 private:
  struct Impl;
  KvEventSubscriber();
  void Loop();
  std::unique_ptr<Impl> impl_;
  std::shared_ptr<KvBlockIndex> index_;
  std::atomic<bool> stop_{false};
  std::atomic<int64_t> messages_{0}, errors_{0}, replayed_{0};
  std::thread thread_;
};

}  // namespace attnd::client
