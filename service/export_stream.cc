// ExportSequence: a sequence's cached keys streamed chunk by chunk (a KV handoff's source).
#include <sys/socket.h>

#include <chrono>
#include <cstring>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "cluster/export_chunk.h"
#include "common/client_text.h"
#include "common/status_macros.h"
#include "engine/layer_check.h"
#include "kv_store/cache_layout.h"
#include "service/attention_service.h"
#include "service/layer_codec.h"
#include "service/service_internal.h"
#include "service/status_map.h"
#include "service/tensor_codec.h"

namespace attnd {

int64_t AttentionService::max_export_chunk_tokens() const {
  const CacheLayout c = CacheLayout::ForModel(engine_->spec(), engine_->options().cache_dtype, 0);
  // A chunk carries each token's cached bytes (fp8: its scales too).
  const int64_t per_token = static_cast<int64_t>(c.latent_row_bytes() + c.index_row_bytes());
  return std::max<int64_t>(1, (options_.max_message_bytes - kMessageFramingBytes) / per_token);
}

// Streams a sequence's keys chunk by chunk, one layer per message; the next message is read out
// of the cache only when the previous one is written (bounded memory for long sequences). Reads
// run on the executor, never on a gRPC thread (a device read may wait for the device).
class ExportStream final : public grpc::ServerWriteReactor<v1::ExportChunk> {
 public:
  ExportStream(AttentionService* svc, const v1::ExportSequenceRequest& req,
               absl::StatusOr<Caller> caller, absl::StatusOr<int64_t> chunk,
               int64_t max_message_bytes)
      : svc_(svc),
        engine_(svc->engine()),
        executor_(svc->executor()),
        max_message_bytes_(max_message_bytes) {
    if (!caller.ok() || !chunk.ok()) {
      End(caller.ok() ? chunk.status() : caller.status());
      return;
    }
    chunk_ = *chunk;
    id_ = KeyOf(*caller, req.sequence_id());
    auto info = Guarded([&] { return engine_->DescribeSequence(id_); });
    if (!info.ok()) {
      End(info.status());
      return;
    }
    length_ = info->length;
    Next();
  }
  void OnWriteDone(bool ok) override {
    if (!ok) {
      End(absl::CancelledError("export: client went away"));
      return;
    }
    Next();
  }
  void OnDone() override { delete this; }

 private:
  void Next() {
    executor_->Post([this] {
      const absl::Status s = Guarded([&] { return Fill(); });
      if (!s.ok()) {
        End(s);
      } else if (done_) {
        End(absl::OkStatus());
      } else {
        StartWrite(&msg_);
      }
    });
  }
  absl::Status Fill() {
    const ModelSpec& s = engine_->spec();
    if (begin_ >= length_) {
      done_ = true;
      return absl::OkStatus();
    }
    const int64_t n = std::min(chunk_, length_ - begin_);
    RETURN_IF_ERROR(ReadExportChunk(*engine_, id_, layer_, begin_, n, length_, &msg_));
    if (++layer_ == s.num_layers()) {
      layer_ = 0;
      begin_ += n;
    }
    if (static_cast<int64_t>(msg_.ByteSizeLong()) > max_message_bytes_)  // cannot happen: chunk_
      return absl::InternalError("export: a chunk outgrew the message limit");  // is bounded
    return absl::OkStatus();
  }

  void End(const absl::Status& s) {
    svc_->Report("ExportSequence", s, started_);
    Finish(ToGrpcStatus(s));
  }

  AttentionService* svc_;
  const std::chrono::steady_clock::time_point started_ = std::chrono::steady_clock::now();
  Engine* engine_;
  Executor* executor_;
  int64_t max_message_bytes_;
  bool done_ = false;
  SequenceKey id_{""};
  int64_t chunk_ = 0;
  int64_t length_ = 0;
  int64_t begin_ = 0;
  int layer_ = 0;
  v1::ExportChunk msg_;
};

absl::StatusOr<int64_t> AttentionService::ExportChunkTokens(
    const v1::ExportSequenceRequest& req) const {
  const int64_t max = max_export_chunk_tokens();
  if (req.chunk_tokens() < 0 || req.chunk_tokens() > max)
    return absl::InvalidArgumentError(absl::StrCat("chunk_tokens: ", req.chunk_tokens(),
                                                   " outside [0, ", max,
                                                   "] (0 = default; at most what fits in a "
                                                   "message of max_message_bytes)"));
  return req.chunk_tokens() > 0 ? req.chunk_tokens() : std::min<int64_t>(4096, max);
}

grpc::ServerWriteReactor<v1::ExportChunk>* AttentionService::ExportSequence(
    grpc::CallbackServerContext* ctx, const v1::ExportSequenceRequest* req) {
  // A sequence's keys: without --auth, for the admin only (under tenants, a tenant's own).
  absl::StatusOr<Caller> caller = Authenticate(*ctx);
  if (caller.ok() && NoAuth())
    if (absl::Status s = RequireAdmin(*caller, "ExportSequence", ""); !s.ok()) caller = s;
  return new ExportStream(this, *req, std::move(caller), ExportChunkTokens(*req),
                          options_.max_message_bytes);
}

}  // namespace attnd
