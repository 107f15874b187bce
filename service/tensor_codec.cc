#include "service/tensor_codec.h"

#include <chrono>
#include <limits>

#include "absl/strings/str_cat.h"
#include "absl/time/clock.h"
#include "common/client_text.h"
#include "common/fp8.h"
#include "common/status_macros.h"

namespace attnd {
namespace {

// Where a shared-memory tensor's view points until its bytes are read: never dereferenced
// (shape checks do not read data), but not null, so a missing tensor stays distinguishable.
const char kNotYetRead = 0;

// *data and *nbytes for `t`'s bytes; shared-memory bytes are queued in `transfers`, to be read
// into a buffer *data then points at.
absl::Status BytesOf(const char* name, const v1::Tensor& t, const ShmAccess& shm,
                     ShmTransfers* transfers, const void** data, size_t* nbytes) {
  if (t.has_shm()) {
    if (!t.data().empty())
      return absl::InvalidArgumentError(absl::StrCat(name, ": both data and shm given"));
    ASSIGN_OR_RETURN(auto r, shm.Resolve(name, t.shm().region(), t.shm().offset(),
                                         t.shm().byte_size(), t.shm().transfer()));
    *data = &kNotYetRead;
    *nbytes = static_cast<size_t>(t.shm().byte_size());
    transfers->inputs.push_back(
        {std::move(r), t.shm().offset(), *nbytes, t.shm().transfer(), data});
    return absl::OkStatus();
  }
  *data = t.data().data();
  *nbytes = t.data().size();
  return absl::OkStatus();
}

// *v viewing `t`'s bytes (and an FP8_E4M3 tensor's scales); shared-memory bytes are queued in
// `transfers` to be read.
absl::Status ViewOf(const char* name, const v1::Tensor& t, const ShmAccess& shm,
                    ShmTransfers* transfers, TensorView* out) {
  TensorView& v = *out;
  v = TensorView();
  if (t.datatype().empty() && t.shape_size() == 0 && t.data().empty() && !t.has_shm() &&
      !t.has_scales())
    return absl::OkStatus();
  const auto dtype = ParseDType(t.datatype());
  if (!dtype)
    return absl::InvalidArgumentError(absl::StrCat(name, ": datatype ", Quote(t.datatype()),
                                                   " is not one of BF16, FP16, FP32, FP8_E4M3"));
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
  RETURN_IF_ERROR(BytesOf(name, t, shm, transfers, &v.data, &v.nbytes));
  if (!t.has_scales()) return absl::OkStatus();
  // The scales: FP32, the tensor's leading dims and a last of their own.
  const v1::Tensor& sc = t.scales();
  const std::string sname = absl::StrCat(name, ".scales");
  if (sc.datatype() != "FP32")
    return absl::InvalidArgumentError(
        absl::StrCat(sname, ": datatype ", Quote(sc.datatype()), ", expected FP32"));
  bool same = v.rank >= 1 && sc.shape_size() == v.rank;
  for (int i = 0; same && i + 1 < v.rank; ++i) same = sc.shape(i) == v.dims[i];
  const int64_t per_row = same ? sc.shape(v.rank - 1) : 0;
  if (!same || per_row <= 0 || v.dims[v.rank - 1] % per_row != 0)
    return absl::InvalidArgumentError(
        absl::StrCat(sname, ": shape must be ", name,
                     "'s leading dims and a last dim dividing its last (", v.ShapeString(), ")"));
  // The scales' element count, refused before count * 4 could overflow.
  constexpr int64_t kMaxCount = std::numeric_limits<int64_t>::max() / 4;
  bool fits = per_row <= kMaxCount;
  int64_t count = per_row;
  for (int i = 0; fits && i + 1 < v.rank; ++i) {
    fits = v.dims[i] == 0 || count <= kMaxCount / v.dims[i];
    if (fits) count *= v.dims[i];
  }
  if (!fits)
    return absl::InvalidArgumentError(
        absl::StrCat(sname, ": too many elements for ", name, "'s shape ", v.ShapeString()));
  if (sc.has_scales()) return absl::InvalidArgumentError(absl::StrCat(sname, ": nested scales"));
  RETURN_IF_ERROR(BytesOf(sname.c_str(), sc, shm, transfers, &v.scales, &v.scales_nbytes));
  if (v.scales_nbytes != static_cast<size_t>(count) * 4)
    return absl::InvalidArgumentError(
        absl::StrCat(sname, ": ", v.scales_nbytes, " bytes, expected ", count * 4));
  v.scales_per_row = per_row;
  return absl::OkStatus();
}

}  // namespace

std::array<std::pair<const char*, const v1::Tensor*>, 8> InputTensors(const v1::LayerInputs& in) {
  return {{{"q_latent", &in.q_latent()},
           {"q_nope", &in.q_nope()},
           {"q_rope", &in.q_rope()},
           {"kv_latent", &in.kv_latent()},
           {"k_rope", &in.k_rope()},
           {"index_q", &in.index_q()},
           {"index_k", &in.index_k()},
           {"index_w", &in.index_w()}}};
}

absl::Status ViewOf(const v1::LayerInputs& in, const ShmAccess& shm, ShmTransfers* transfers,
                    LayerInputs* out) {
  TensorView* const views[] = {&out->q_latent, &out->q_nope,  &out->q_rope,  &out->kv_latent,
                               &out->k_rope,   &out->index_q, &out->index_k, &out->index_w};
  const auto tensors = InputTensors(in);  // in the order of `views`
  for (size_t i = 0; i < tensors.size(); ++i)
    RETURN_IF_ERROR(ViewOf(tensors[i].first, *tensors[i].second, shm, transfers, views[i]));
  return absl::OkStatus();
}

absl::Status ShmTransfers::ReadInputs() {
  const auto t0 = std::chrono::steady_clock::now();
  // No waiting here: the service ran the call once its transfers had landed (or failed to), so
  // no executor thread waits for a client's bytes (AttentionService::AfterLandings).
  const absl::Time now = absl::Now();
  for (Pending& p : inputs) {
    if (p.target == nullptr) continue;  // already read
    // In place where the bytes are in server memory (a data plane's input region), else copied.
    ASSIGN_OR_RETURN(const char* view, p.region->View(p.offset, p.bytes, p.transfer, now));
    if (view == nullptr) {
      buffers.push_back(std::make_unique<std::string>(p.bytes, '\0'));
      RETURN_IF_ERROR(p.region->Read(p.offset, buffers.back()->data(), p.bytes, p.transfer, now));
      view = buffers.back()->data();
    }
    *p.target = view;
    p.target = nullptr;
  }
  seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return absl::OkStatus();
}

absl::Status ShmTransfers::CheckOutputRegions() const {
  for (const Pending& o : outputs) RETURN_IF_ERROR(o.region->CheckStillCovers(o.offset, o.bytes));
  return absl::OkStatus();
}

absl::Status ShmTransfers::WriteOutputs() {
  const auto t0 = std::chrono::steady_clock::now();
  for (const Pending& o : outputs)
    RETURN_IF_ERROR(o.region->Write(o.offset, o.staged, o.bytes, o.transfer));
  seconds += std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return absl::OkStatus();
}

absl::StatusOr<void*> PrepareOutput(const v1::LayerInputs& in, v1::Tensor* out, DType dtype,
                                    int64_t tokens, int heads, int latent,
                                    int64_t max_message_bytes, const ShmAccess& shm,
                                    ShmTransfers* transfers) {
  // tokens, heads and latent are the engine's (bounded), so the product cannot overflow.
  const int64_t bytes = tokens * heads * latent * static_cast<int64_t>(DTypeSize(dtype));
  if (in.has_out_shm()) {
    if (in.out_shm().byte_size() != bytes)
      return absl::InvalidArgumentError(
          absl::StrCat("out_shm: byte_size ", in.out_shm().byte_size(), ", expected ", bytes,
                       " for [", tokens, ", ", heads, ", ", latent, "] in ", DTypeName(dtype)));
    ASSIGN_OR_RETURN(auto r, shm.Resolve("out_shm", in.out_shm().region(), in.out_shm().offset(),
                                         bytes, in.out_shm().transfer()));
    char* staged = r->Staging(in.out_shm().offset(), static_cast<size_t>(bytes));
    if (staged == nullptr) {
      transfers->output_buffers.push_back(
          std::make_unique<std::string>(static_cast<size_t>(bytes), '\0'));
      staged = transfers->output_buffers.back()->data();
    }
    transfers->outputs.push_back({std::move(r), in.out_shm().offset(), static_cast<size_t>(bytes),
                                  in.out_shm().transfer(), nullptr, staged});
  } else if (bytes > max_message_bytes - kMessageFramingBytes) {
    return absl::InvalidArgumentError(absl::StrCat(
        "output: ", bytes, " bytes would not fit in a reply of at most ", max_message_bytes,
        " bytes (max_message_bytes); name an out_shm region or send fewer tokens per step"));
  }
  out->set_datatype(std::string(DTypeName(dtype)));
  out->clear_shape();
  out->add_shape(tokens);
  out->add_shape(heads);
  out->add_shape(latent);
  if (in.has_out_shm()) {
    *out->mutable_shm() = in.out_shm();
    out->clear_data();
    return static_cast<void*>(transfers->outputs.back().staged);
  }
  std::string* data = out->mutable_data();
  data->resize(static_cast<size_t>(bytes));
  return static_cast<void*>(data->data());
}

absl::StatusOr<bool> ReplyDType(const v1::LayerInputs& in, bool write_only, LayerInputs* views) {
  views->out_dtype.reset();
  if (in.out_datatype().empty()) return false;
  const std::optional<DType> dt = ParseDType(in.out_datatype());
  if (!dt)
    return absl::InvalidArgumentError(absl::StrCat("out_datatype: ", Quote(in.out_datatype()),
                                                   " is not one of BF16, FP16, FP32, FP8_E4M3"));
  if (write_only)
    return absl::InvalidArgumentError(
        "out_datatype: given on a write-only step, which has no output");
  if (*dt != DType::kFP8E4M3) {
    views->out_dtype = *dt;
    return false;
  }
  if (in.has_out_shm())
    return absl::InvalidArgumentError(
        "out_datatype: FP8_E4M3 travels in the reply with its scales; out_shm takes BF16, FP16 "
        "or FP32");
  views->out_dtype = DType::kF32;
  return true;
}

void QuantizeReply(const float* values, int64_t tokens, int heads, int width, v1::Tensor* out) {
  const int64_t rows = tokens * heads;
  out->Clear();
  out->set_datatype(std::string(DTypeName(DType::kFP8E4M3)));
  for (int64_t d : {tokens, static_cast<int64_t>(heads), static_cast<int64_t>(width)})
    out->add_shape(d);
  std::string* codes = out->mutable_data();
  codes->resize(static_cast<size_t>(rows) * width);
  v1::Tensor* sc = out->mutable_scales();
  sc->set_datatype(std::string(DTypeName(DType::kF32)));
  for (int64_t d : {tokens, static_cast<int64_t>(heads), int64_t{1}}) sc->add_shape(d);
  std::vector<float> scales(static_cast<size_t>(rows));
  fp8::QuantizeTiles(values, rows * width, width, reinterpret_cast<uint8_t*>(codes->data()),
                     scales.data());  // a tile per row
  sc->mutable_data()->assign(reinterpret_cast<const char*>(scales.data()), 4 * scales.size());
}

}  // namespace attnd
