// The C++ client of attnd.v1: sequences, steps over the stream (fast path) or unary calls, and a
// helper to build wire tensors. Synchronous; one Client may be shared by threads, one StepStream
// may not.
//
//   auto client = attnd::client::Client::Connect("localhost:50051");
//   client->OpenSequence("req-1");
//   auto stream = client->OpenStream();
//   auto begun = stream->Begin({{"req-1", 128}});
//   for (int l = 0; l < num_layers; ++l) auto out = stream->Layer(inputs[l]);  // commits at last
#pragma once

#include <grpcpp/grpcpp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "attnd/v1/attention.grpc.pb.h"
#include "common/dtype.h"

namespace attnd::client {

// (sequence id, q_len) in batch order.
using Batch = std::vector<std::pair<std::string, int64_t>>;

// The BeginStep request for `batch` (what Client::BeginStep and StepStream::Begin send).
v1::BeginStepRequest MakeBeginRequest(const Batch& batch, bool write_only = false,
                                      int num_shards = 0);

// A wire tensor holding a copy of `data` (bytes in `dtype`, row-major).
v1::Tensor MakeTensor(DType dtype, const std::vector<int64_t>& shape, const void* data,
                      size_t bytes);

// An FP8_E4M3 wire tensor of the fp32 `values` (row-major; a row is the last dim): each row's
// e4m3 codes with one FP32 power-of-two scale (scales [..., 1]), as queries may travel.
v1::Tensor MakeFp8Tensor(const std::vector<int64_t>& shape, const float* values);

// A tensor's values in fp32 (its bytes, not shared memory): BF16, FP16 and FP32 converted,
// FP8_E4M3 dequantised with its scales. INVALID_ARGUMENT when the bytes or scales do not match
// the shape.
absl::StatusOr<std::vector<float>> TensorValues(const v1::Tensor& t);

// A wire tensor whose bytes are in a registered shared-memory region.
v1::Tensor ShmTensor(DType dtype, const std::vector<int64_t>& shape, const std::string& region,
                     int64_t offset);

// A POSIX shared-memory object this process creates and maps (unlinked on destruction), for
// passing tensors to a co-located attnd without copying them through gRPC.
class SharedMemory {
 public:
  static absl::StatusOr<std::unique_ptr<SharedMemory>> Create(const std::string& key, size_t bytes);
  ~SharedMemory();
  uint8_t* data() const { return static_cast<uint8_t*>(base_); }
  size_t size() const { return size_; }
  const std::string& key() const { return key_; }

 private:
  SharedMemory() = default;
  std::string key_;
  void* base_ = nullptr;
  size_t size_ = 0;
};

// The bearer token on the first line of the file `path` (a mounted Secret), trailing whitespace
// dropped. NOT_FOUND when it cannot be read.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

// gRPC status -> absl::Status, same code and message.
absl::Status FromGrpc(const grpc::Status& s);
// The same for a call this client did not cancel itself, with one exception: gRPC ends a call
// that reached a server as it shut down, before a handler took it, with CANCELLED "CANCELLED"
// (grpc/grpc#41785; newer gRPC says UNAVAILABLE). Nobody cancelled it here, so it is the server
// going away (a drained replica exiting): UNAVAILABLE, which callers treat as a miss and retry.
absl::Status FromGrpcNotCancelled(const grpc::Status& s);

class StepStream;
class Client;
class DataPlaneSession;

// Whether gRPC target `target` reaches this host only: a Unix socket, localhost, 127.0.0.0/8 or
// ::1 (with or without a dns:, ipv4: or ipv6: scheme). A data plane to such a server keeps this
// end's UCX on the loopback interfaces (UCX's TCP transport listens on every interface
// otherwise, and a host that reaches it can write this process's memory: docs/trust.md).
bool IsLocalTarget(absl::string_view target);

// How to reach a server (docs/trust.md). Without a CA the channel is plaintext.
struct ConnectOptions {
  int max_message_bytes = 1 << 30;  // raises the channel's send/receive limits
  std::string tls_ca_file;          // PEM: verify the server against this CA (enables TLS)
  std::string tls_cert_file;        // PEM: this client's certificate chain (mTLS)
  std::string tls_key_file;         // PEM: its private key
  std::string tls_server_name;      // the name to verify instead of the target's host
  std::string token;                // sent as `authorization: Bearer <token>` on every call
  std::string act_as_tenant;        // the admin only: act inside this tenant's namespace
  int64_t call_timeout_ms = 0;      // each unary call's deadline (0 = none; streams have none)
  // > 0: the channel reconnects after a failure this soon, backing off to 20x (gRPC's default
  // starts at 1 s and grows to 120 s: long for replicas that come back at once).
  int64_t reconnect_backoff_ms = 0;
  // The UCX data plane (docs/data-plane.md): "auto" connects one in the background from the
  // first layer call on when the server offers it (calls go as gRPC bytes until it is ready)
  // and sends tensors through it (gRPC bytes otherwise, and for any call the plane's regions
  // cannot take at the moment); "off" never does.
  std::string data_plane = "auto";
  int64_t data_plane_bytes = int64_t{64} << 20;  // each region (capped by the server's limit)
};

// Copies sequence `id` from `from` to `to` (ExportSequence there, write-only steps here), in
// chunks of `chunk_tokens`. On failure the partial copy on `to` is closed. The source is left
// as it was; close it once the copy is confirmed.
absl::Status HandOffSequence(Client& from, Client& to, const std::string& id,
                             int64_t chunk_tokens = 4096);

class Client {
 public:
  // max_message_bytes raises the channel's send/receive limits (layer messages are large).
  // "unix:/path" reaches the server's Unix-socket listener (shared memory).
  static std::unique_ptr<Client> Connect(const std::string& target,
                                         int max_message_bytes = 1 << 30);
  // INVALID_ARGUMENT when a certificate file cannot be read.
  static absl::StatusOr<std::unique_ptr<Client>> Connect(const std::string& target,
                                                         const ConnectOptions& options);
  ~Client();

  absl::StatusOr<v1::ServerInfoResponse> Info();
  // Empty parent: a fresh sequence; otherwise a fork of the parent's first prefix_len tokens.
  // import_length > 0: a handoff target (see OpenSequenceRequest.import_length).
  absl::StatusOr<v1::SequenceInfo> OpenSequence(const std::string& id,
                                                const std::string& parent = "",
                                                int64_t prefix_len = 0, int64_t import_length = 0);
  // Any open, as the request says (a prompt for the prefix cache: prompt_token_ids or
  // prompt_block_hashes; SequenceInfo.cached_tokens in the reply).
  absl::StatusOr<v1::SequenceInfo> OpenSequence(const v1::OpenSequenceRequest& request);
  // How many leading blocks of a prompt this server's prefix cache holds for this tenant.
  absl::StatusOr<v1::LookupPrefixResponse> LookupPrefix(const v1::LookupPrefixRequest& request);
  // standby_generation nonzero: only if it is a standby copy at that generation (replication;
  // FAILED_PRECONDITION otherwise, nothing closed).
  absl::Status CloseSequence(const std::string& id, uint64_t standby_generation = 0);
  // lease_ms > 0 (the replicas' admin identity, on a standby copy): renews the primary's lease
  // on it (docs/replication.md#leases).
  absl::StatusOr<v1::SequenceInfo> DescribeSequence(const std::string& id, int64_t lease_ms = 0);
  // Failover (docs/replication.md): promotes this server's standby copy of `id` at `generation`
  // (the one its failed primary reported) to the sequence, cut back to `length` tokens when it
  // holds more; `failed_replica` is not chosen as its next standby. UNAVAILABLE while its
  // primary's lease runs, unless `release_lease`: the primary serves it no more (it hands it over
  // itself, or its address refuses connections: the process is gone).
  absl::StatusOr<v1::SequenceInfo> PromoteSequence(const std::string& id, uint64_t generation,
                                                   int64_t length,
                                                   const std::string& failed_replica = "",
                                                   bool release_lease = false);
  // This tenant's sequences, or (the admin only) every tenant's.
  absl::StatusOr<v1::ListSequencesResponse> ListSequences(bool all_tenants = false);
  // The tiers below the devices (docs/architecture.md#tiers). Prefetch: restore these spilled
  // sequences in the background (answers at once). Offload: spill them down a tier now
  // (answers once they are there).
  absl::Status PrefetchSequences(const std::vector<std::string>& ids);
  absl::Status OffloadSequences(const std::vector<std::string>& ids);

  // Unary steps.
  // num_shards > 1 opens a sharded step (this caller is shard 0; see attention.proto).
  absl::StatusOr<v1::BeginStepResponse> BeginStep(const Batch& batch, bool write_only = false,
                                                  int num_shards = 0);
  // Any step, as the request says (context parallelism's fields, say).
  absl::StatusOr<v1::BeginStepResponse> BeginStep(const v1::BeginStepRequest& request);
  absl::StatusOr<v1::LayerOutput> AttendLayer(uint64_t step_id, const v1::LayerInputs& in);
  // The same with the output written to `out` (see StepStream::Layer).
  absl::StatusOr<v1::LayerOutput> AttendLayer(uint64_t step_id, const v1::LayerInputs& in,
                                              void* out, size_t out_bytes);
  absl::Status AbortStep(uint64_t step_id);
  // Shared memory (see attention.proto): a region `name` over [offset, offset + bytes) of `key`.
  absl::Status RegisterSharedMemory(const std::string& name, const std::string& key, int64_t offset,
                                    int64_t bytes);
  absl::Status UnregisterSharedMemory(const std::string& name);
  // The data plane (docs/data-plane.md): connects one now (FAILED_PRECONDITION when the server
  // offers none). With ConnectOptions.data_plane "auto" the first layer call starts this in the
  // background itself.
  absl::Status ConnectDataPlane();
  // The plane's name ("ucx-3") once connected, else "".
  std::string DataPlaneName() const;
  // Diagnostics: a round trip of `payload` out and `response_bytes` back.
  absl::Status Echo(const std::string& payload, int64_t response_bytes);

  // A bidirectional step stream; many steps may follow on it. deadline_ms > 0 bounds the whole
  // stream (its calls then fail DEADLINE_EXCEEDED).
  std::unique_ptr<StepStream> OpenStream(int64_t deadline_ms = 0);

  v1::Attention::Stub* stub() { return stub_.get(); }
  std::shared_ptr<grpc::Channel> channel() const { return channel_; }
  // Adds this client's credentials metadata to a context (for calls made through stub()).
  void Authorize(grpc::ClientContext* ctx) const;
  // Authorize, and the deadline of ConnectOptions.call_timeout_ms: for a unary call.
  void PrepareUnary(grpc::ClientContext* ctx) const;

 private:
  using Metadata = std::vector<std::pair<std::string, std::string>>;
  Client(std::shared_ptr<grpc::Channel> channel, Metadata metadata, int64_t call_timeout_ms);
  friend class StepStream;
  // The connected plane (null: none, send bytes); under "auto", a call that finds none (or a
  // broken one, which is dropped) starts connecting one in the background (ProbePlane).
  std::shared_ptr<DataPlaneSession> Plane() const;
  // Asks the server for a plane and connects it (plane_probe_'s thread).
  void ProbePlane() const;
  // Asks the server to close `old` (best effort, 1 s): its memory is freed now rather than after
  // it stood idle. Calls still holding it fail there.
  void RetirePlane(const std::shared_ptr<DataPlaneSession>& old) const;
  std::shared_ptr<grpc::Channel> channel_;
  std::unique_ptr<v1::Attention::Stub> stub_;
  Metadata metadata_;
  int64_t call_timeout_ms_ = 0;
  std::string data_plane_mode_ = "auto";
  int64_t data_plane_bytes_ = 0;
  bool local_target_ = false;  // IsLocalTarget(the target): the plane's UCX on loopback only
  mutable std::mutex plane_mu_;
  mutable std::shared_ptr<DataPlaneSession> plane_;
  // When Plane() may next ask the server for a plane (max: it has none; it was asked).
  mutable std::chrono::steady_clock::time_point plane_next_probe_{};
  mutable bool plane_probing_ = false;  // one probe at a time; other calls send bytes meanwhile
  mutable int plane_failures_ = 0;      // probes failed in a row (each waits twice as long)
  mutable std::thread plane_probe_;     // the last probe's thread (joined by the next, or ~Client)
};

// One Step RPC. After any error the stream is finished (the server aborted the open step) and
// every later call returns that error. It uses its Client (the channel, the data plane): destroy
// it before the Client.
class StepStream {
 public:
  ~StepStream();
  absl::StatusOr<v1::BeginStepResponse> Begin(const Batch& batch, bool write_only = false,
                                              int num_shards = 0);
  // Any step, as the request says (generations, write-only imports of several sequences).
  absl::StatusOr<v1::BeginStepResponse> Begin(const v1::BeginStepRequest& request);
  // Attaches this stream as shard `shard` of another stream's sharded step.
  absl::StatusOr<v1::BeginStepResponse> Join(uint64_t step_id, int shard);
  // Sends the next layer and waits for its output; committed is set on the last layer (and, on a
  // replica with standbys, protection: where each batch entry's committed rows stand).
  absl::StatusOr<v1::LayerOutput> Layer(const v1::LayerInputs& in);
  // Layer with the output written to `out` (out_bytes: exactly its size, [T, H, L or V] in its
  // datatype) instead of LayerOutput.out's data, which stays empty. On the data plane the
  // server's bytes land there directly (no copy); otherwise they are copied from the reply.
  // INVALID_ARGUMENT when out_bytes is not the output's size (the layer ran).
  absl::StatusOr<v1::LayerOutput> Layer(const v1::LayerInputs& in, void* out, size_t out_bytes);
  // Layer without waiting: the call runs on this stream's own thread (started on first use) and
  // the future holds its outcome. Calls run one at a time, in the order they were made. The
  // micro-batch pattern (docs/data-plane.md#micro-batches, examples/microbatch.cc): one stream
  // per micro-batch, a micro-batch's attention in flight while the worker runs another's FFN.
  // Other calls on this stream wait until the futures they follow are ready (Cancel, from any
  // thread, ends them first). Destroying the stream cancels those not ready.
  std::future<absl::StatusOr<v1::LayerOutput>> LayerAsync(v1::LayerInputs in, void* out = nullptr,
                                                          size_t out_bytes = 0);
  absl::Status Abort();
  // Half-closes and returns the call's final status.
  absl::Status Close();
  // Cancels the call (as a crashed client would): the server aborts any open step. Returns once
  // the server has released the open step's sequences (bounded wait), so a new step may use
  // them at once. It may be called from another thread while LayerAsync calls are queued or
  // being made (they end CANCELLED); not while a thread makes a synchronous call on the stream.
  void Cancel();

 private:
  friend class Client;
  StepStream(const Client& client, v1::Attention::Stub* stub, int64_t deadline_ms);
  // `sent` (when given) is set once the request may have reached the server.
  absl::StatusOr<v1::StepResponse> RoundTrip(const v1::StepRequest& req, bool* sent = nullptr);
  // OK while the stream can carry calls; why not otherwise.
  absl::Status Usable() const;
  // Layer without waiting for LayerAsync's queue (what its thread runs).
  absl::StatusOr<v1::LayerOutput> LayerNow(const v1::LayerInputs& in, void* dest,
                                           size_t dest_bytes);
  // Waits until LayerAsync's queue is empty and nothing of it runs.
  void AwaitQueued();

  void RunQueued();

  const Client& client_;
  v1::Attention::Stub* stub_;
  // LayerAsync's thread and its queue.
  std::mutex async_mu_;
  std::condition_variable async_cv_;
  std::deque<std::function<void()>> async_queue_;
  std::condition_variable async_idle_;  // the queue emptied and nothing of it runs
  bool async_running_ = false;
  std::atomic<bool> cancelled_{false};  // Cancel (or the destructor) cancelled the call
  bool async_stop_ = false;
  std::thread async_thread_;
  grpc::ClientContext ctx_;
  std::unique_ptr<grpc::ClientReaderWriter<v1::StepRequest, v1::StepResponse>> rw_;
  std::vector<std::string> open_ids_;  // the open step's sequences
  absl::Status error_;
  bool closed_ = false;
};

}  // namespace attnd::client
