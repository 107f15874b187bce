// Sharded steps (tensor-parallel workers, docs/architecture.md): each shard's message parks in
// ShardGather until every shard's is in, then one engine layer runs over all heads and each shard
// gets its heads back.
#include <sys/socket.h>

#include <chrono>
#include <cstring>
#include <mutex>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
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

absl::StatusOr<int64_t> AttentionService::Join(const StepRef& step, int shard) {
  RETURN_IF_ERROR(shards_.CheckJoin(step, shard));
  ASSIGN_OR_RETURN(Engine::StepInfo info, engine_->DescribeStep(step));
  return info.tokens;
}

void AttentionService::AbortEverywhere(const StepRef& step, const absl::Status& why,
                                       AbortReason reason) {
  (void)engine_->AbortStep(step, reason);
  shards_.Fail(step, why);
}

void AttentionService::FailParkedShards() {
  for (const StepRef& step : shards_.Steps())
    AbortEverywhere(step, absl::CancelledError("attnd is shutting down; step aborted"),
                    AbortReason::kDrain);
}

void AttentionService::ReapShards(std::chrono::steady_clock::duration idle) {
  // Steps the engine no longer has (expired while no shard was waiting): answer any parked part
  // now and drop the entry, which would otherwise stay until every shard's stream ends.
  for (const StepRef& step : shards_.Steps())
    if (!engine_->DescribeStep(step).ok())
      shards_.Fail(step, absl::DeadlineExceededError(
                             absl::StrCat("step ", step.id, " expired or ended; step aborted")));
  for (const StepRef& step : shards_.Stale(idle))
    AbortEverywhere(step,
                    absl::DeadlineExceededError(absl::StrCat(
                        "step ", step.id, ": a shard's layer message never came; step aborted")),
                    AbortReason::kExpiry);
}

absl::Status AttentionService::LayerSharded(const StepRef& step,
                                            const std::vector<ShardGather::Part>& parts,
                                            Transport transport) {
  const auto start = std::chrono::steady_clock::now();
  ASSIGN_OR_RETURN(Engine::StepInfo info, engine_->DescribeStep(step));
  const ModelSpec& s = engine_->spec();
  const int S = static_cast<int>(parts.size());
  const int Hs = s.num_heads / S, L = s.kv_lora_rank, R = s.qk_rope_head_dim;
  const int64_t T = info.tokens;
  std::vector<LayerInputs> v(S);
  ShmTransfers shm;
  for (int k = 0; k < S; ++k) {
    if (parts[k].in->return_attended())
      return absl::InvalidArgumentError(
          absl::StrCat("shard ", k, ": return_attended is not served on sharded steps"));
    if (parts[k].in->return_candidates() || parts[k].in->has_selection())
      return absl::InvalidArgumentError(absl::StrCat(
          "shard ", k, ": return_candidates and selection belong to context-parallel steps"));
    if (!parts[k].in->out_datatype().empty())
      return absl::InvalidArgumentError(absl::StrCat(
          "shard ", k,
          ": out_datatype is not served on sharded steps (the reply is in q_latent's)"));
    RETURN_IF_ERROR(ViewOf(*parts[k].in, parts[k].shm, &shm, &v[k]));
    if (v[k].q_nope.present)
      return absl::InvalidArgumentError(absl::StrCat(
          "shard ", k,
          ": q_nope (server-side absorption) is not served on sharded steps; send q_latent"));
    const std::string ql = absl::StrCat("q_latent (shard ", k, ")");
    const std::string qr = absl::StrCat("q_rope (shard ", k, ")");
    RETURN_IF_ERROR(CheckTensor(ql.c_str(), v[k].q_latent, {T, Hs, L}));
    RETURN_IF_ERROR(CheckTensor(qr.c_str(), v[k].q_rope, {T, Hs, R}));
    if (v[k].q_latent.dtype == DType::kFP8E4M3 || v[k].q_rope.dtype == DType::kFP8E4M3 ||
        v[k].q_latent.scales != nullptr || v[k].q_rope.scales != nullptr)
      return absl::InvalidArgumentError(absl::StrCat(
          "shard ", k,
          ": FP8_E4M3 q_latent/q_rope are not served on sharded steps; send BF16 or FP32"));
    if (v[k].q_latent.dtype != v[0].q_latent.dtype || v[k].q_rope.dtype != v[0].q_rope.dtype)
      return absl::InvalidArgumentError(
          absl::StrCat("shard ", k, ": q_latent/q_rope datatypes differ from shard 0's"));
    if (k > 0 && (v[k].kv_latent.present || v[k].k_rope.present || v[k].index_q.present ||
                  v[k].index_k.present || v[k].index_w.present))
      return absl::InvalidArgumentError(absl::StrCat(
          "shard ", k, ": only shard 0 sends kv_latent, k_rope and the indexer tensors"));
  }
  const int layer = parts[0].in->layer();
  const DType dt = v[0].q_latent.dtype;
  // All heads, token-major: [T, H, *] gathered from S slices of [T, H/S, *] once the inputs are
  // read (the sink's Prepare); sized now, so the request's views can point at them.
  std::string ql(v[0].q_latent.nbytes * S, '\0'), qr(v[0].q_rope.nbytes * S, '\0');
  LayerRequest request;
  request.layer = layer;
  request.tensors = v[0];  // shard 0's keys and indexer tensors
  request.tensors.q_latent = TensorView::Of(dt, {T, s.num_heads, L}, ql.data(), ql.size());
  request.tensors.q_rope =
      TensorView::Of(v[0].q_rope.dtype, {T, s.num_heads, R}, qr.data(), qr.size());
  for (int k = 0; k < S; ++k) request.want_lse |= parts[k].in->return_lse();
  // Every shard's output buffer before the layer runs: the last layer commits, so nothing may
  // fail after it.
  std::string out;
  std::vector<char*> dst(S);
  auto gather = [&](auto member, int dim, std::string* full) {
    const size_t slice = static_cast<size_t>(Hs) * dim * DTypeSize((v[0].*member).dtype);
    for (int64_t t = 0; t < T; ++t)
      for (int k = 0; k < S; ++k)
        std::memcpy(full->data() + (t * S + k) * slice,
                    static_cast<const char*>((v[k].*member).data) + t * slice, slice);
  };
  struct ShardSink final : LayerSink {
    std::function<absl::StatusOr<void*>(const LayerShape&)> fn;
    absl::StatusOr<void*> Prepare(const LayerShape& shape) override { return fn(shape); }
  } sink;
  sink.fn = [&](const LayerShape& shape) -> absl::StatusOr<void*> {
    LayerShape mine = shape;  // each shard's reply: its heads
    mine.heads = Hs;
    mine.out_bytes = shape.out_bytes / S;
    for (int k = 0; k < S; ++k) {
      mine.lse_floats = parts[k].in->return_lse() ? static_cast<size_t>(T) * Hs : 0;
      if (absl::Status fits = CheckReplyFits(mine, *parts[k].in, false, reply_limits()); !fits.ok())
        return absl::InvalidArgumentError(absl::StrCat("shard ", k, ": ", fits.message()));
    }
    for (int k = 0; k < S; ++k) {
      ASSIGN_OR_RETURN(void* out_k,
                       PrepareOutput(*parts[k].in, parts[k].out->mutable_out(), dt, T, Hs, L,
                                     options_.max_message_bytes, parts[k].shm, &shm));
      dst[k] = static_cast<char*>(out_k);
    }
    RETURN_IF_ERROR(shm.ReadInputs());
    // Shard 0's key and indexer views, now read (their shared-memory bytes are in `shm`).
    LayerInputs& all = request.tensors;
    all.kv_latent = v[0].kv_latent;
    all.k_rope = v[0].k_rope;
    all.index_q = v[0].index_q;
    all.index_k = v[0].index_k;
    all.index_w = v[0].index_w;
    gather(&LayerInputs::q_latent, L, &ql);
    gather(&LayerInputs::q_rope, R, &qr);
    RETURN_IF_ERROR(shm.CheckOutputRegions());
    out.assign(shape.out_bytes, '\0');
    return static_cast<void*>(out.data());
  };
  ASSIGN_OR_RETURN(const LayerResult result, engine_->RunLayer(step, request, &sink));
  const std::vector<float>& lse = result.lse;
  const size_t slice = static_cast<size_t>(Hs) * L * DTypeSize(dt);
  for (int k = 0; k < S; ++k) {
    for (int64_t t = 0; t < T; ++t)
      std::memcpy(dst[k] + t * slice, out.data() + (t * S + k) * slice, slice);
    if (parts[k].in->return_lse())
      SetLse(lse, T, s.num_heads, k * Hs, Hs, parts[k].out->mutable_lse());
    parts[k].out->set_layer(layer);
    parts[k].out->set_committed(layer == s.num_layers() - 1);
  }
  if (absl::Status w = shm.WriteOutputs(); !w.ok())  // the caller aborts the step
    return OutputWriteError(step.id, layer == s.num_layers() - 1, w);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  size_t received = 0, sent = 0;
  for (const auto& p : parts) {
    p.out->set_server_seconds(seconds);
    p.out->set_transfer_seconds(shm.seconds);
    received += p.in->ByteSizeLong();
    sent += p.out->ByteSizeLong();
  }
  metrics_->LayerDone(transport, info.phase, s.layers[layer], seconds, received, sent);
  if (layer == s.num_layers() - 1)
    metrics_->StepDone(
        info.phase,
        std::chrono::duration<double>(std::chrono::steady_clock::now() - info.begun).count());
  return absl::OkStatus();
}

}  // namespace attnd
