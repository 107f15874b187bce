// StepStream (client/attnd_client.h): one Step stream's steps, layer by layer, and LayerAsync's
// thread for micro-batches in flight.
#include <chrono>
#include <string>
#include <thread>
#include <utility>

#include "client/attnd_client.h"
#include "client/data_plane_session.h"

namespace attnd::client {

StepStream::StepStream(const Client& client, v1::Attention::Stub* stub, int64_t deadline_ms)
    : client_(client), stub_(stub) {
  client_.Authorize(&ctx_);
  if (deadline_ms > 0)
    ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(deadline_ms));
  rw_ = stub->Step(&ctx_);
}

StepStream::~StepStream() {
  if (async_thread_.joinable()) {
    bool pending;
    {
      std::lock_guard<std::mutex> lock(async_mu_);
      async_stop_ = true;
      pending = async_running_ || !async_queue_.empty();
    }
    // Layers still queued or running when the stream goes were given up on: cancelled, so that
    // they end now (their futures CANCELLED) rather than whenever the server answers.
    if (pending) {
      cancelled_.store(true);
      ctx_.TryCancel();
    }
    async_cv_.notify_all();
    async_thread_.join();
  }
  if (!closed_) {
    ctx_.TryCancel();
    (void)rw_->Finish();
  }
}

absl::Status StepStream::Usable() const {
  if (!error_.ok()) return error_;
  if (closed_) return absl::FailedPreconditionError("stream closed");
  // Layers queued behind a cancel stage nothing: only one under way at the cancel has an
  // unknown outcome (and breaks the plane).
  if (cancelled_.load()) return absl::CancelledError("stream cancelled");
  return absl::OkStatus();
}

void StepStream::AwaitQueued() {
  std::unique_lock<std::mutex> lock(async_mu_);
  async_idle_.wait(lock, [&] { return !async_running_ && async_queue_.empty(); });
}

absl::StatusOr<v1::StepResponse> StepStream::RoundTrip(const v1::StepRequest& req, bool* sent) {
  if (absl::Status s = Usable(); !s.ok()) return s;
  if (sent != nullptr) *sent = true;  // from here the server may have it
  v1::StepResponse resp;
  if (!rw_->Write(req) || !rw_->Read(&resp)) {
    closed_ = true;
    // CANCELLED is the server going away, unless this stream was cancelled (Cancel, or its
    // destruction with layers queued).
    error_ = cancelled_.load() ? FromGrpc(rw_->Finish()) : FromGrpcNotCancelled(rw_->Finish());
    if (error_.ok()) error_ = absl::UnavailableError("stream ended without a reply");
    return error_;
  }
  return resp;
}

absl::StatusOr<v1::BeginStepResponse> StepStream::Begin(const Batch& batch, bool write_only,
                                                        int num_shards) {
  return Begin(MakeBeginRequest(batch, write_only, num_shards));
}

absl::StatusOr<v1::BeginStepResponse> StepStream::Begin(const v1::BeginStepRequest& request) {
  AwaitQueued();
  v1::StepRequest req;
  *req.mutable_begin() = request;
  auto resp = RoundTrip(req);
  if (!resp.ok()) return resp.status();
  open_ids_.clear();
  for (const auto& e : request.batch()) open_ids_.push_back(e.sequence_id());
  return std::move(*resp->mutable_begun());
}

absl::StatusOr<v1::BeginStepResponse> StepStream::Join(uint64_t step_id, int shard) {
  AwaitQueued();
  v1::StepRequest req;
  req.mutable_join()->set_step_id(step_id);
  req.mutable_join()->set_shard(shard);
  auto resp = RoundTrip(req);
  if (!resp.ok()) return resp.status();
  return std::move(*resp->mutable_joined());
}

absl::StatusOr<v1::LayerOutput> StepStream::Layer(const v1::LayerInputs& in) {
  return Layer(in, nullptr, 0);
}

absl::StatusOr<v1::LayerOutput> StepStream::Layer(const v1::LayerInputs& in, void* dest,
                                                  size_t dest_bytes) {
  AwaitQueued();
  return LayerNow(in, dest, dest_bytes);
}

absl::StatusOr<v1::LayerOutput> StepStream::LayerNow(const v1::LayerInputs& in, void* dest,
                                                     size_t dest_bytes) {
  // A stream that failed or closed sends nothing: its plane is neither used nor told of a
  // failure (an unknown outcome breaks the plane every other caller shares).
  if (absl::Status s = Usable(); !s.ok()) return s;
  v1::StepRequest req;
  std::shared_ptr<DataPlaneSession> plane = client_.Plane();
  DataPlaneSession::Call call;
  if (plane == nullptr ||
      !plane->Stage(in, req.mutable_layer(), &call, static_cast<char*>(dest), dest_bytes))
    *req.mutable_layer() = in;
  bool sent = false;
  auto resp = RoundTrip(req, &sent);
  if (!resp.ok()) {
    // Not sent (the stream was cancelled or closed meanwhile): the call's space goes back as
    // after any call. Sent: its outcome is unknown and the plane breaks.
    if (plane != nullptr && sent) plane->Failed(resp.status());
    return resp.status();
  }
  if (plane != nullptr)
    if (absl::Status f = plane->Finish(&call, resp->mutable_layer()); !f.ok()) return f;
  if (absl::Status f = IntoCallerBuffer(resp->mutable_layer(), dest, dest_bytes); !f.ok()) return f;
  if (resp->layer().committed()) open_ids_.clear();
  return std::move(*resp->mutable_layer());
}

void StepStream::RunQueued() {
  for (;;) {
    std::function<void()> fn;
    {
      std::unique_lock<std::mutex> lock(async_mu_);
      async_running_ = false;
      async_idle_.notify_all();
      async_cv_.wait(lock, [&] { return async_stop_ || !async_queue_.empty(); });
      if (async_queue_.empty()) return;
      fn = std::move(async_queue_.front());
      async_queue_.pop_front();
      async_running_ = true;
    }
    fn();
  }
}

std::future<absl::StatusOr<v1::LayerOutput>> StepStream::LayerAsync(v1::LayerInputs in, void* out,
                                                                    size_t out_bytes) {
  auto task = std::make_shared<std::packaged_task<absl::StatusOr<v1::LayerOutput>()>>(
      [this, in = std::move(in), out, out_bytes] { return LayerNow(in, out, out_bytes); });
  std::future<absl::StatusOr<v1::LayerOutput>> result = task->get_future();
  {
    std::lock_guard<std::mutex> lock(async_mu_);
    if (cancelled_.load()) {  // queued after a Cancel's wait would race with its Finish
      std::promise<absl::StatusOr<v1::LayerOutput>> now;
      now.set_value(absl::CancelledError("stream cancelled"));
      return now.get_future();
    }
    if (!async_thread_.joinable()) async_thread_ = std::thread([this] { RunQueued(); });
    async_queue_.push_back([task] { (*task)(); });
  }
  async_cv_.notify_one();
  return result;
}

absl::Status StepStream::Abort() {
  AwaitQueued();
  v1::StepRequest req;
  req.mutable_abort();
  open_ids_.clear();  // the reply comes after the server released the step
  return RoundTrip(req).status();
}

absl::Status StepStream::Close() {
  AwaitQueued();
  if (closed_) return error_;
  closed_ = true;
  rw_->WritesDone();
  error_ = FromGrpcNotCancelled(rw_->Finish());
  return error_;
}

void StepStream::Cancel() {
  cancelled_.store(true);
  ctx_.TryCancel();
  AwaitQueued();  // layers under way or queued end at once (the stream is cancelled)
  if (!closed_) {
    closed_ = true;
    error_ = FromGrpc(rw_->Finish());
    if (error_.ok()) error_ = absl::CancelledError("stream cancelled");
  }
  // The server aborts the open step when the cancel reaches it (a running layer finishes
  // first). Wait, bounded, until it let go of the step's sequences, so the caller can begin a
  // new step with them at once.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  for (const std::string& id : open_ids_) {
    while (std::chrono::steady_clock::now() < deadline) {
      grpc::ClientContext ctx;
      client_.Authorize(&ctx);
      ctx.set_deadline(std::chrono::system_clock::now() +
                       (deadline - std::chrono::steady_clock::now()));
      v1::DescribeSequenceRequest req;
      req.set_sequence_id(id);
      v1::SequenceInfo info;
      if (!stub_->DescribeSequence(&ctx, req, &info).ok() || !info.in_step()) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
  }
  open_ids_.clear();
}

}  // namespace attnd::client
