// UploadAbsorption: server-side absorption's weights, layer by layer, handed to the engine
// when the last layer is in.
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

grpc::ServerUnaryReactor* AttentionService::UploadAbsorption(grpc::CallbackServerContext* ctx,
                                                             const v1::UploadAbsorptionRequest* req,
                                                             v1::UploadAbsorptionResponse* resp) {
  return Unary(ctx, "UploadAbsorption",
               [&](const Caller& c) { return DoUploadAbsorption(c, *req, resp); });
}

absl::Status AttentionService::DoUploadAbsorption(const Caller& caller,
                                                  const v1::UploadAbsorptionRequest& req,
                                                  v1::UploadAbsorptionResponse* resp) {
  RETURN_IF_ERROR(RequireAdmin(caller, "UploadAbsorption", ": the weights serve every tenant"));
  const ModelSpec& s = engine_->spec();
  const int layers = s.num_layers();
  if (req.first_layer() < 0 || req.first_layer() >= layers ||
      req.kv_b_proj_size() > layers - req.first_layer())
    return absl::InvalidArgumentError(absl::StrCat(
        "UploadAbsorption: layers [", req.first_layer(), ", ",
        int64_t{req.first_layer()} + req.kv_b_proj_size(), ") outside the model's ", layers));
  std::lock_guard<std::mutex> lock(upload_mu_);
  if (upload_ == nullptr || upload_->qk_nope_head_dim() != req.qk_nope_head_dim() ||
      upload_->v_head_dim() != req.v_head_dim()) {  // a new upload (other dims restart it)
    ASSIGN_OR_RETURN(upload_,
                     Absorption::Create(s, req.qk_nope_head_dim(), req.v_head_dim(), "upload"));
  }
  std::vector<float> w;
  for (int i = 0; i < req.kv_b_proj_size(); ++i) {
    const v1::Tensor& t = req.kv_b_proj(i);
    const int layer = req.first_layer() + i;
    const std::string name = absl::StrCat("kv_b_proj[", i, "] (layer ", layer, ")");
    const std::optional<DType> dt = ParseDType(t.datatype());
    if (!dt || *dt == DType::kFP8E4M3)
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": datatype ", Quote(t.datatype()), "; send FP32, BF16 or FP16"));
    if (t.has_shm() || t.has_scales())
      return absl::InvalidArgumentError(absl::StrCat(name, ": give the bytes inline"));
    const std::vector<int64_t> shape(t.shape().begin(), t.shape().end());
    const int64_t want = int64_t{s.num_heads} * (req.qk_nope_head_dim() + req.v_head_dim());
    if (shape.size() != 2 || shape[0] != want || shape[1] != s.kv_lora_rank)
      return absl::InvalidArgumentError(absl::StrCat(name, ": shape [", absl::StrJoin(shape, ", "),
                                                     "], expected [H*(Dn+V), L] = [", want, ", ",
                                                     s.kv_lora_rank, "]"));
    const size_t n = static_cast<size_t>(want) * s.kv_lora_rank;
    if (t.data().size() != n * DTypeSize(*dt))
      return absl::InvalidArgumentError(
          absl::StrCat(name, ": ", t.data().size(), " bytes, expected ", n * DTypeSize(*dt)));
    w.resize(n);
    ConvertToF32(*dt, t.data().data(), w.data(), n);
    RETURN_IF_ERROR(upload_->SetLayer(layer, shape, w.data()));
  }
  resp->set_layers_received(upload_->layers_set());
  if (!upload_->complete()) return absl::OkStatus();
  std::shared_ptr<const Absorption> done(std::move(upload_));
  upload_.reset();
  RETURN_IF_ERROR(engine_->SetAbsorption(std::move(done)));
  resp->set_complete(true);
  return absl::OkStatus();
}

}  // namespace attnd
