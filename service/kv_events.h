// KV events (docs/prefix_cache.md#kv-events): every prefix-cache block indexed or removed, and a
// cleared cache at start, published over ZeroMQ PUB in vLLM's KV-event schema so that llm-d's and
// Dynamo's routers (and attnd's own, client/python/attnd/kv_events.py) can follow what each
// replica holds. A message is three frames, as vLLM's publisher sends them:
//   topic   "kv@<replica>@<tenant>"
//   seq     8 bytes, big-endian: +1 per message, skipping one whenever events were dropped, so a
//           subscriber sees every gap (and a restart: the count starts at 0 again)
//   payload msgpack EventBatch [ts, events, data_parallel_rank]: the rank is the device index;
//           events BlockStored [tag, block_hashes, parent_block_hash, token_ids, block_size,
//           lora_id, medium], BlockRemoved [tag, block_hashes, medium], AllBlocksCleared [tag]
//           (sent at start with tenant "" and no rank: the whole replica).
// Publish() is called under the engine's lock: it only queues. A thread encodes and sends; a
// full queue drops events (counted). The socket never blocks (ZeroMQ's high-water mark drops
// for a slow subscriber).
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "kv_store/sequence_table.h"

namespace attnd {

struct KvEventsOptions {
  std::string endpoint;  // a ZeroMQ bind endpoint: "tcp://*:5557", "ipc:///run/attnd/kv"
  std::string replica;   // --replica-name
  int32_t block_size = 64;
  // The medium each device's blocks are on ("GPU" for CUDA devices, "CPU" for CPU devices);
  // the host tier is "CPU" and the disk tier "DISK".
  std::vector<std::string> device_medium;
  size_t max_queue = 65536;  // events waiting to be sent
};

// Encodes one batch (tests decode it with msgpack and vLLM's schema). `device` < 0: no rank.
std::string EncodeKvEventBatch(double ts, const std::vector<PrefixEvent>& events, int device,
                               int32_t block_size, const std::vector<std::string>& device_medium,
                               bool cleared);

class KvEventPublisher {
 public:
  // Binds the endpoint (a clear startup error when it cannot) and sends AllBlocksCleared.
  static absl::StatusOr<std::unique_ptr<KvEventPublisher>> Create(const KvEventsOptions& options);
  ~KvEventPublisher();  // sends what is queued, then stops

  void Publish(const PrefixEvent& event);
  // The endpoint bound ("tcp://0.0.0.0:41234" for a "tcp://*:0" request).
  const std::string& endpoint() const { return bound_; }
  int64_t events_published() const { return published_.load(); }
  int64_t events_dropped() const { return dropped_.load(); }

 private:
  struct Impl;
  explicit KvEventPublisher(const KvEventsOptions& options);
  void Loop();
  void Send(const std::string& tenant, int device, const std::vector<PrefixEvent>& events,
            bool cleared);

  KvEventsOptions options_;
  std::unique_ptr<Impl> impl_;  // the ZeroMQ context and socket
  std::string bound_;
  std::mutex mu_;
  std::condition_variable wake_;
  std::deque<PrefixEvent> queue_;
  bool stopping_ = false;
  bool gap_ = false;  // events dropped since the last message
  uint64_t seq_ = 0;
  std::atomic<int64_t> published_{0}, dropped_{0};
  std::thread thread_;
};

}  // namespace attnd
