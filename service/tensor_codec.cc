#include "service/tensor_codec.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace attnd {

absl::StatusOr<TensorView> ViewOf(const char* name, const v1::Tensor& t, const ShmRegistry& shm,
                                  RegionHolds* holds) {
  TensorView v;
  if (t.datatype().empty() && t.shape_size() == 0 && t.data().empty() && !t.has_shm()) return v;
  const auto dtype = ParseDType(t.datatype());
  if (!dtype)
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": datatype '", t.datatype(), "' is not one of BF16, FP16, FP32"));
  if (t.shape_size() > TensorView::kMaxRank)
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": rank ", t.shape_size(), " exceeds ", TensorView::kMaxRank));
  v.present = true;
  v.dtype = *dtype;
  v.rank = t.shape_size();
  for (int i = 0; i < v.rank; ++i) {
    if (t.shape(i) < 0)
      return absl::InvalidArgumentError(absl::StrCat(name, ": negative dimension ", t.shape(i)));
    v.dims[i] = t.shape(i);
  }
  if (t.has_shm()) {
    if (!t.data().empty())
      return absl::InvalidArgumentError(absl::StrCat(name, ": both data and shm given"));
    ASSIGN_OR_RETURN(auto r,
                     shm.Resolve(name, t.shm().region(), t.shm().offset(), t.shm().byte_size()));
    v.data = r.second;
    v.nbytes = static_cast<size_t>(t.shm().byte_size());
    holds->push_back(std::move(r.first));
    return v;
  }
  v.data = t.data().data();
  v.nbytes = t.data().size();
  return v;
}

absl::StatusOr<LayerInputs> ViewOf(const v1::LayerInputs& in, const ShmRegistry& shm,
                                   RegionHolds* holds) {
  LayerInputs out;
  ASSIGN_OR_RETURN(out.q_latent, ViewOf("q_latent", in.q_latent(), shm, holds));
  ASSIGN_OR_RETURN(out.q_rope, ViewOf("q_rope", in.q_rope(), shm, holds));
  ASSIGN_OR_RETURN(out.kv_latent, ViewOf("kv_latent", in.kv_latent(), shm, holds));
  ASSIGN_OR_RETURN(out.k_rope, ViewOf("k_rope", in.k_rope(), shm, holds));
  ASSIGN_OR_RETURN(out.index_q, ViewOf("index_q", in.index_q(), shm, holds));
  ASSIGN_OR_RETURN(out.index_k, ViewOf("index_k", in.index_k(), shm, holds));
  ASSIGN_OR_RETURN(out.index_w, ViewOf("index_w", in.index_w(), shm, holds));
  return out;
}

absl::StatusOr<void*> PrepareOutput(const v1::LayerInputs& in, v1::Tensor* out, DType dtype,
                                    int64_t tokens, int heads, int latent, const ShmRegistry& shm,
                                    RegionHolds* holds) {
  out->set_datatype(std::string(DTypeName(dtype)));
  out->clear_shape();
  out->add_shape(tokens);
  out->add_shape(heads);
  out->add_shape(latent);
  const int64_t bytes = tokens * heads * latent * static_cast<int64_t>(DTypeSize(dtype));
  if (in.has_out_shm()) {
    if (in.out_shm().byte_size() != bytes)
      return absl::InvalidArgumentError(absl::StrCat("out_shm: byte_size ",
                                                     in.out_shm().byte_size(), ", expected ", bytes,
                                                     " for [T, H, L] in ", DTypeName(dtype)));
    ASSIGN_OR_RETURN(auto r,
                     shm.Resolve("out_shm", in.out_shm().region(), in.out_shm().offset(), bytes));
    *out->mutable_shm() = in.out_shm();
    out->clear_data();
    holds->push_back(std::move(r.first));
    return static_cast<void*>(r.second);
  }
  std::string* data = out->mutable_data();
  data->resize(static_cast<size_t>(bytes));
  return static_cast<void*>(data->data());
}

}  // namespace attnd
