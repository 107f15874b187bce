#include "service/tensor_codec.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace attnd {

absl::StatusOr<TensorView> ViewOf(const char* name, const v1::Tensor& t) {
  TensorView v;
  if (t.datatype().empty() && t.shape_size() == 0 && t.data().empty()) return v;
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
  v.data = t.data().data();
  v.nbytes = t.data().size();
  return v;
}

absl::StatusOr<LayerInputs> ViewOf(const v1::LayerInputs& in) {
  LayerInputs out;
  ASSIGN_OR_RETURN(out.q_latent, ViewOf("q_latent", in.q_latent()));
  ASSIGN_OR_RETURN(out.q_rope, ViewOf("q_rope", in.q_rope()));
  ASSIGN_OR_RETURN(out.kv_latent, ViewOf("kv_latent", in.kv_latent()));
  ASSIGN_OR_RETURN(out.k_rope, ViewOf("k_rope", in.k_rope()));
  ASSIGN_OR_RETURN(out.index_q, ViewOf("index_q", in.index_q()));
  ASSIGN_OR_RETURN(out.index_k, ViewOf("index_k", in.index_k()));
  ASSIGN_OR_RETURN(out.index_w, ViewOf("index_w", in.index_w()));
  return out;
}

void* PrepareOutput(v1::Tensor* out, DType dtype, int64_t tokens, int heads, int latent) {
  out->set_datatype(std::string(DTypeName(dtype)));
  out->clear_shape();
  out->add_shape(tokens);
  out->add_shape(heads);
  out->add_shape(latent);
  std::string* data = out->mutable_data();
  data->resize(static_cast<size_t>(tokens) * heads * latent * DTypeSize(dtype));
  return data->data();
}

}  // namespace attnd
