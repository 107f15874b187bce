// KV events (docs/prefix_cache.md#kv-events): every prefix-cache block indexed or removed, and a
// cleared cache at start, published over ZeroMQ PUB in vLLM's KV-event schema so that llm-d's and
// Dynamo's routers (and attnd's own, client/kv_events.h and client/python/attnd/kv_events.py) can
// follow what each replica holds. A message is three frames, as vLLM's publisher sends them:
//   topic   "kv@<replica>@<tenant>", the tenant with '%' and '@' written %25 and %40 (so the
//           topic splits at '@' into exactly three parts, as llm-d splits it)
//   seq     8 bytes, big-endian, counted per topic from the publisher's start time in
//           microseconds since the epoch: +1 per message, skipping one whenever that topic's
//           events were dropped, so a subscriber of one tenant sees every gap, and a restart is a
//           jump past every number the last run used
//   payload msgpack EventBatch [ts, events, data_parallel_rank] (the rank: the device index).
//           Events are vLLM's current tagged maps ({"type": "BlockStored", "block_hashes": ...},
//           vLLM PR #42892) or, with array_form, the older tagged arrays
//           ["BlockStored", block_hashes, parent, token_ids, block_size, lora_id, medium].
//           AllBlocksCleared is sent at start on "kv@<replica>@" (the whole replica).
// With a replay endpoint, a ROUTER socket answers vLLM's replay requests from a bounded buffer of
// what was published: [identity, "", start_seq (8 bytes BE)], optionally + a topic frame to
// replay one topic only; each message with seq >= start comes back as [identity, "", topic, seq,
// payload] (vLLM PR #45177's layout), then [identity, "", "", 8 x 0xFF, ""]. The start's
// AllBlocksCleared is always kept, so a subscriber that joined late, or missed a restart, learns
// the replica began empty.
// Publish() is called under the engine's lock: it only queues. A thread encodes and sends; a
// full queue drops events (counted). The sockets never block (a slow peer loses messages at
// ZeroMQ's high-water mark).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "kv_store/sequence_table.h"

namespace attnd {

struct KvEventsOptions {
  std::string endpoint;         // a ZeroMQ bind endpoint: "tcp://*:5557", "ipc:///run/attnd/kv"
  std::string replay_endpoint;  // ROUTER bind endpoint; "" = no replay
  int64_t replay_bytes = int64_t{64} << 20;  // payload bytes the replay buffer keeps
  size_t replay_messages = 10000;            // and at most this many messages (vLLM's default)
  bool array_form = false;                   // vLLM's tagged arrays, for consumers before #42892
  std::string replica;                       // --replica-name
  int32_t block_size = 64;
  // The medium each device's blocks are on ("GPU" for CUDA devices, "CPU" for CPU devices);
  // the host tier is "CPU" and the disk tier "STORAGE" (vLLM's name; "DISK" in the array form).
  std::vector<std::string> device_medium;
  size_t max_queue = 65536;  // events waiting to be sent
};

// Encodes one batch. `device` < 0: no rank.
std::string EncodeKvEventBatch(double ts, const std::vector<PrefixEvent>& events, int device,
                               const KvEventsOptions& options, bool cleared);
// "kv@<replica>@<tenant>" with the tenant's '%' and '@' escaped.
std::string KvEventTopic(const std::string& replica, const std::string& tenant);

class KvEventPublisher {
 public:
  // Binds the endpoints (a clear startup error when one cannot be) and sends AllBlocksCleared.
  static absl::StatusOr<std::unique_ptr<KvEventPublisher>> Create(const KvEventsOptions& options);
  ~KvEventPublisher();  // sends what is queued, then stops

  void Publish(const PrefixEvent& event);
  // The endpoints bound ("tcp://0.0.0.0:41234" for a "tcp://*:0" request; "" when none).
  const std::string& endpoint() const { return bound_; }
  const std::string& replay_endpoint() const { return replay_bound_; }
  bool array_form() const { return options_.array_form; }
  int64_t events_published() const { return published_.load(); }
  int64_t events_dropped() const { return dropped_.load(); }

 private:
  struct Impl;
  struct Sent {  // a published message, kept for replay
    std::string topic;
    uint64_t seq = 0;
    std::shared_ptr<const std::string> payload;
  };
  explicit KvEventPublisher(const KvEventsOptions& options);
  void Loop();
  void ReplayLoop();
  void Send(const std::string& tenant, int device, const std::vector<PrefixEvent>& events,
            bool cleared);

  KvEventsOptions options_;
  std::unique_ptr<Impl> impl_;  // the ZeroMQ context and sockets
  std::string bound_, replay_bound_;
  const uint64_t first_seq_;  // every topic's first number: the start, in microseconds
  std::mutex mu_;
  std::condition_variable wake_;
  std::deque<PrefixEvent> queue_;
  bool stopping_ = false;
  std::set<std::string> gapped_;          // tenants whose events were dropped since their last
  std::map<std::string, uint64_t> next_;  // topic -> its next number (the sending thread's)
  std::mutex replay_mu_;                  // guards the three below
  Sent cleared_;                          // the start's AllBlocksCleared, never dropped
  std::deque<Sent> sent_;
  int64_t sent_bytes_ = 0;
  std::atomic<bool> replay_stop_{false};
  std::atomic<int64_t> published_{0}, dropped_{0};
  std::thread thread_, replay_thread_;
};

}  // namespace attnd
