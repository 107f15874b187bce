#include "client/data_plane_session.h"

#include <cstring>
#include <utility>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "client/attnd_client.h"
#include "common/dtype.h"
#include "transport/ucx_plane_client.h"

namespace attnd::client {
namespace {

// How long a call waits for its own sends and output beyond the reply (the server already
// waited for both, --data-plane-timeout-ms).
constexpr absl::Duration kSettle = absl::Seconds(5);

// The tensors whose bytes the plane carries (scales stay in the message: they are small).
std::vector<std::pair<const v1::Tensor*, v1::Tensor*>> Tensors(const v1::LayerInputs& in,
                                                               v1::LayerInputs* wire) {
  std::vector<std::pair<const v1::Tensor*, v1::Tensor*>> t;
  auto add = [&](bool has, const v1::Tensor& a, v1::Tensor* (v1::LayerInputs::*mut)()) {
    if (has) t.emplace_back(&a, (wire->*mut)());
  };
  add(in.has_q_latent(), in.q_latent(), &v1::LayerInputs::mutable_q_latent);
  add(in.has_q_nope(), in.q_nope(), &v1::LayerInputs::mutable_q_nope);
  add(in.has_q_rope(), in.q_rope(), &v1::LayerInputs::mutable_q_rope);
  add(in.has_kv_latent(), in.kv_latent(), &v1::LayerInputs::mutable_kv_latent);
  add(in.has_k_rope(), in.k_rope(), &v1::LayerInputs::mutable_k_rope);
  add(in.has_index_q(), in.index_q(), &v1::LayerInputs::mutable_index_q);
  add(in.has_index_k(), in.index_k(), &v1::LayerInputs::mutable_index_k);
  add(in.has_index_w(), in.index_w(), &v1::LayerInputs::mutable_index_w);
  return t;
}

}  // namespace

absl::StatusOr<std::unique_ptr<DataPlaneSession>> DataPlaneSession::Connect(
    v1::Attention::Stub* stub, const v1::ServerInfoResponse& info, int64_t region_bytes,
    const std::function<void(grpc::ClientContext*)>& prepare, bool local) {
  bool ucx = false;
  for (const std::string& p : info.data_plane().planes()) ucx = ucx || p == "ucx";
  if (!ucx) return absl::FailedPreconditionError("the server has no UCX data plane");
  const int64_t bytes = std::min(region_bytes, info.data_plane().max_region_bytes());
  std::unique_ptr<DataPlaneSession> s(new DataPlaneSession());
  auto ends = transport::UcxPlaneClient::Create(bytes, local ? transport::LoopbackDevices() : "");
  if (!ends.ok()) return ends.status();
  s->ends_ = std::move(*ends);
  grpc::ClientContext ctx;
  prepare(&ctx);
  v1::ConnectDataPlaneRequest req;
  req.set_input_bytes(bytes);
  req.set_output_bytes(bytes);
  req.set_worker_address(s->ends_->address());  // outputs are then sent as soon as built
  req.set_sends_keepalives(true);
  v1::ConnectDataPlaneResponse resp;
  if (absl::Status st = FromGrpc(stub->ConnectDataPlane(&ctx, req, &resp)); !st.ok()) return st;
  if (absl::Status st = s->ends_->Attach(resp.plane_id(), resp.token(), resp.worker_address(),
                                         bytes, resp.pushes_outputs());
      !st.ok()) {
    // This end cannot reach the server's (its UCX port out of reach): the plane the server made
    // is closed now rather than left to stand silent until it is reaped.
    grpc::ClientContext close_ctx;
    prepare(&close_ctx);
    v1::CloseDataPlaneRequest close;
    close.set_plane(resp.plane());
    v1::CloseDataPlaneResponse closed;
    (void)stub->CloseDataPlane(&close_ctx, close, &closed);
    return st;
  }
  if (resp.keepalive_ms() > 0) s->ends_->KeepAlive(absl::Milliseconds(resp.keepalive_ms()));
  s->plane_ = resp.plane();
  s->input_region_ = resp.input_region();
  s->output_region_ = resp.output_region();
  s->kv_lora_rank_ = info.model().kv_lora_rank();
  s->v_head_dim_ = info.has_absorption() ? info.absorption().v_head_dim() : 0;
  return s;
}

DataPlaneSession::~DataPlaneSession() = default;

DataPlaneSession::Call::~Call() {
  if (session == nullptr) return;
  for (auto& p : sends)
    if (!p->Wait(absl::Now() + kSettle).ok()) session->broken_ = true;  // the endpoint is closed
  if (output_offset >= 0) session->ends_->Forget(output_transfer);
  // A broken plane takes no more calls, and the server may still be using a failed call's space
  // (Failed: its outcome unknown): that space goes to no other call (one that took the plane
  // before it broke stages on).
  if (session->broken()) return;
  for (int64_t off : input_space) session->ends_->input_space().Give(off);
  if (output_offset >= 0) session->ends_->output_space().Give(output_offset);
}

bool DataPlaneSession::Stage(const v1::LayerInputs& in, v1::LayerInputs* wire, Call* call,
                             char* dest, size_t dest_bytes) {
  call->session = this;
  if (broken()) return false;  // it broke since the caller took it: this call goes as bytes
  // Everything but the tensors' bytes, copied field by field (the bytes are the bulk).
  wire->Clear();
  wire->set_layer(in.layer());
  wire->set_shard(in.shard());
  if (in.has_out_shm()) *wire->mutable_out_shm() = in.out_shm();
  wire->set_return_attended(in.return_attended());
  wire->set_return_lse(in.return_lse());
  wire->set_out_datatype(in.out_datatype());
  wire->set_return_candidates(in.return_candidates());
  if (in.has_selection()) *wire->mutable_selection() = in.selection();
  // Every tensor's bytes in one message (one transfer): back to back in the input region.
  std::vector<transport::UcxWorker::Piece> pieces;
  std::vector<v1::SharedMemoryRef*> refs;
  int64_t total = 0;
  for (auto [from, to] : Tensors(in, wire)) {
    to->set_datatype(from->datatype());
    *to->mutable_shape() = from->shape();
    if (from->has_scales()) *to->mutable_scales() = from->scales();
    if (from->has_shm() || from->data().empty()) {  // already a region's, or no bytes
      if (from->has_shm()) *to->mutable_shm() = from->shm();
      continue;
    }
    v1::SharedMemoryRef* ref = to->mutable_shm();
    ref->set_region(input_region_);
    ref->set_offset(total);
    ref->set_byte_size(static_cast<int64_t>(from->data().size()));
    refs.push_back(ref);
    pieces.push_back({from->data().data(), from->data().size()});
    total += static_cast<int64_t>(from->data().size());
  }
  bool moved = false;
  if (total > 0) {
    const int64_t at = ends_->input_space().Take(total);
    if (at < 0) return false;  // full now: this call goes in the message
    call->input_space.push_back(at);
    const uint64_t t = ends_->NextTransfer();
    for (v1::SharedMemoryRef* ref : refs) {
      ref->set_offset(at + ref->offset());
      ref->set_transfer(t);
    }
    call->sends.push_back(ends_->PutPieces(std::move(pieces), at, t));
    moved = true;
  }
  // The output, when it would come back in the reply and its size is known here.
  const v1::Tensor& q = in.has_q_nope() ? in.q_nope() : in.q_latent();
  const int width = in.has_q_nope() ? v_head_dim_ : kv_lora_rank_;
  std::optional<DType> dt =
      in.out_datatype().empty() ? ParseDType(q.datatype()) : ParseDType(in.out_datatype());
  if (dt == DType::kFP8E4M3 && in.out_datatype().empty()) dt = DType::kBF16;
  if (!in.has_out_shm() && (in.has_q_latent() || in.has_q_nope()) && q.shape_size() == 3 &&
      width > 0 && dt && *dt != DType::kFP8E4M3 && ends_->output_bytes() > 0) {
    const int64_t bytes = q.shape(0) * q.shape(1) * width * static_cast<int64_t>(DTypeSize(*dt));
    const int64_t at =
        bytes > 0 && bytes <= ends_->output_bytes() ? ends_->output_space().Take(bytes) : -1;
    if (at >= 0) {
      call->output_offset = at;
      call->output_transfer = ends_->NextTransfer();
      ends_->Want(call->output_transfer);
      call->output_bytes = static_cast<size_t>(bytes);
      if (dest != nullptr && dest_bytes == call->output_bytes) {
        ends_->Expect(call->output_transfer, dest, dest_bytes);
        call->to_dest = true;
      }
      auto* ref = wire->mutable_out_shm();
      ref->set_region(output_region_);
      ref->set_offset(at);
      ref->set_byte_size(bytes);
      ref->set_transfer(call->output_transfer);
      moved = true;
    }
  }
  return moved;
}

void DataPlaneSession::Failed(const absl::Status& s) {
  if (absl::StrContains(s.message(), absl::StrCat("no data plane region ", plane_, ".")) ||
      absl::StrContains(s.message(), absl::StrCat("data plane ", plane_, " was closed")))
    broken_ = true;
  // A call whose outcome on the server is unknown (the client gave up, or the connection did)
  // may still be reading its inputs and building its output in this plane's regions: the
  // space it gives back must not be handed to another call, so the plane is retired (the next
  // call connects a new one).
  switch (s.code()) {
    case absl::StatusCode::kDeadlineExceeded:
    case absl::StatusCode::kCancelled:
    case absl::StatusCode::kUnavailable:
    case absl::StatusCode::kUnknown:
      broken_ = true;
      break;
    default:
      break;
  }
}

bool DataPlaneSession::broken() const { return broken_ || !ends_->Lost().ok(); }

absl::Status DataPlaneSession::Finish(Call* call, v1::LayerOutput* out) {
  for (auto& p : call->sends)
    if (absl::Status s = p->Wait(absl::Now() + kSettle); !s.ok()) {
      broken_ = true;  // a send that never completed closed the endpoint
      return s;
    }
  call->sends.clear();
  if (call->output_offset < 0 || !out->has_out() || !out->out().has_shm() ||
      out->out().shm().region() != output_region_)
    return absl::OkStatus();
  auto bytes = ends_->Await(call->output_transfer, call->output_offset, call->output_bytes,
                            absl::Now() + kSettle);
  if (!bytes.ok()) {
    if (bytes.status().code() != absl::StatusCode::kNotFound) broken_ = true;
    return bytes.status();
  }
  v1::Tensor* t = out->mutable_out();
  t->clear_shm();
  if (!call->to_dest) t->mutable_data()->assign(*bytes, call->output_bytes);
  return absl::OkStatus();
}

absl::Status IntoCallerBuffer(v1::LayerOutput* out, void* dest, size_t bytes) {
  if (dest == nullptr || out->out().data().empty()) return absl::OkStatus();
  if (out->out().data().size() != bytes || out->out().has_scales())
    return absl::InvalidArgumentError(
        absl::StrCat("out_bytes: ", bytes, ", the output has ", out->out().data().size(),
                     out->out().has_scales() ? " bytes with scales (an FP8 reply)" : " bytes"));
  std::memcpy(dest, out->out().data().data(), bytes);
  out->mutable_out()->clear_data();
  return absl::OkStatus();
}

}  // namespace attnd::client
