#include "service/layer_codec.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "service/status_map.h"

namespace attnd {

absl::Status DecodeLayer(const v1::LayerInputs& in, const Engine::StepInfo& info,
                         const ShmAccess& shm, DecodedLayer* out) {
  LayerRequest& r = out->request;
  r.layer = in.layer();
  const bool candidates = in.return_candidates();
  // The table in attention.proto's LayerInputs, case for case.
  if (info.write_only && in.has_out_shm())
    return absl::InvalidArgumentError("out_shm: given on a write-only step, which has no output");
  if (candidates || in.has_selection()) {
    if (!info.context_parallel)
      return absl::FailedPreconditionError(
          "return_candidates and selection belong to context-parallel steps (BeginStep "
          "context_parallel)");
    if (candidates && (in.has_selection() || in.has_out_shm() || !in.out_datatype().empty() ||
                       in.return_attended() || in.return_lse()))
      return absl::InvalidArgumentError(
          "return_candidates: the call attends nothing; no selection, out_shm, out_datatype, "
          "return_attended or return_lse");
  }
  RETURN_IF_ERROR(ViewOf(in, shm, &out->shm, &r.tensors));
  if (candidates) {
    r.mode = LayerMode::kCandidates;
    return absl::OkStatus();
  }
  if (in.has_selection()) {
    const v1::Candidates& c = in.selection();  // bounded by the request's size
    Candidates& sel = out->selection;
    sel.pages = c.pages();
    sel.keep = c.keep();
    sel.count.assign(c.count().begin(), c.count().end());
    sel.keys.assign(c.keys().begin(), c.keys().end());
    sel.scores.assign(c.scores().begin(), c.scores().end());
    r.mode = LayerMode::kSelection;
    r.selection = &sel;
  }
  ASSIGN_OR_RETURN(out->fp8_reply, ReplyDType(in, info.write_only, &r.tensors));
  if (in.return_attended() && info.write_only)
    return absl::InvalidArgumentError("return_attended: a write-only step attends nothing");
  if (in.return_lse() && info.write_only)
    return absl::InvalidArgumentError("return_lse: a write-only step attends nothing");
  r.want_trace = in.return_attended();
  r.want_lse = in.return_lse();
  return absl::OkStatus();
}

absl::Status CheckReplyFits(const LayerShape& shape, const v1::LayerInputs& in, bool fp8_reply,
                            const ReplyLimits& limits) {
  const int64_t room = limits.max_message_bytes - kMessageFramingBytes;
  const int64_t rows = shape.tokens * shape.heads;
  // The output as it travels: nothing when it goes to shared memory, e4m3 codes and a scale per
  // row for an FP8 reply.
  const int64_t out = in.has_out_shm() ? 0
                      : fp8_reply      ? rows * (shape.width + 4)
                                       : static_cast<int64_t>(shape.out_bytes);
  const int64_t lse = static_cast<int64_t>(shape.lse_floats) * 4;
  if (in.return_attended()) {
    const int64_t bound = shape.trace_positions;
    if (bound > limits.max_attended_positions)
      return absl::InvalidArgumentError(absl::StrCat(
          "return_attended: this layer's queries may attend ", bound, " keys in all; at most ",
          limits.max_attended_positions,
          " positions come back (ServerInfo.limits.max_attended_positions): trace fewer tokens"));
    // Packed positions take at most 5 bytes each, a query's entry about 12 more.
    const int64_t reply = out + 5 * bound + 12 * shape.tokens + lse;
    if (reply > room)
      return absl::InvalidArgumentError(absl::StrCat(
          "return_attended: the output and up to ", bound, " positions (", reply,
          " bytes) would not fit in a reply of --max-message-bytes=", limits.max_message_bytes,
          "; send the output to shared memory (out_shm) or trace fewer tokens"));
  }
  if (in.return_lse() && out + lse > room)
    return absl::InvalidArgumentError(absl::StrCat(
        "return_lse: the output and its log-sum-exp (", out + lse,
        " bytes) would not fit in a reply of --max-message-bytes=", limits.max_message_bytes,
        "; send the output to shared memory (out_shm) or fewer tokens per step"));
  if (shape.candidates_per_query > 0) {
    // Each query's candidates: at most K (or the budget) of 13 bytes or so.
    const int64_t reply = shape.tokens * (shape.candidates_per_query * 16 + 8);
    if (reply > room)
      return absl::InvalidArgumentError(
          absl::StrCat("return_candidates: up to ", reply,
                       " bytes of candidates would not fit in a reply of "
                       "--max-message-bytes=",
                       limits.max_message_bytes, "; send fewer tokens per step"));
  }
  if (out > room)
    return absl::InvalidArgumentError(
        absl::StrCat("output: ", out, " bytes would not fit in a reply of at most ",
                     limits.max_message_bytes, " bytes (max_message_bytes); ",
                     fp8_reply ? "send fewer tokens per step"
                               : "name an out_shm region or send fewer tokens per step"));
  return absl::OkStatus();
}

absl::StatusOr<void*> ReplySink::Prepare(const LayerShape& shape) {
  RETURN_IF_ERROR(CheckReplyFits(shape, in_, decoded_->fp8_reply, limits_));
  void* buf = nullptr;
  if (decoded_->fp8_reply) {  // the engine writes FP32 here; the reply carries e4m3 and scales
    staged_.assign(shape.out_bytes, '\0');
    buf = staged_.data();
  } else if (shape.out_bytes > 0) {
    ASSIGN_OR_RETURN(
        buf, PrepareOutput(in_, out_->mutable_out(), shape.out_dtype, shape.tokens, shape.heads,
                           shape.width, limits_.max_message_bytes, shm_, &decoded_->shm));
  }
  RETURN_IF_ERROR(decoded_->shm.ReadInputs());
  RETURN_IF_ERROR(decoded_->shm.CheckOutputRegions());
  return buf;
}

void SetLse(const std::vector<float>& lse, int64_t tokens, int heads, int h0, int hn,
            v1::Tensor* t) {
  t->set_datatype("FP32");
  t->add_shape(tokens);
  t->add_shape(hn);
  std::string* d = t->mutable_data();
  d->resize(static_cast<size_t>(tokens) * hn * 4);
  for (int64_t i = 0; i < tokens; ++i)
    std::memcpy(d->data() + i * hn * 4, lse.data() + i * heads + h0, static_cast<size_t>(hn) * 4);
}

void EncodeLayerResult(const LayerResult& result, const v1::LayerInputs& in,
                       const DecodedLayer& decoded, const ReplySink& sink, v1::LayerOutput* out) {
  const LayerShape& shape = result.shape;
  if (decoded.request.mode == LayerMode::kCandidates) {
    const Candidates& c = result.candidates;
    v1::Candidates* w = out->mutable_candidates();
    w->set_pages(c.pages);
    w->set_keep(c.keep);
    w->mutable_count()->Add(c.count.begin(), c.count.end());
    w->mutable_keys()->Add(c.keys.begin(), c.keys.end());
    w->mutable_scores()->Add(c.scores.begin(), c.scores.end());
  }
  if (in.return_lse())
    SetLse(result.lse, shape.tokens, shape.heads, 0, shape.heads, out->mutable_lse());
  if (decoded.fp8_reply)
    QuantizeReply(reinterpret_cast<const float*>(sink.staged().data()), shape.tokens, shape.heads,
                  shape.width, out->mutable_out());
  for (const std::vector<int32_t>& keys : result.trace.keys)
    out->add_attended()->mutable_positions()->Add(keys.begin(), keys.end());
  out->set_layer(in.layer());
  out->set_committed(result.committed);
}

}  // namespace attnd
