#include "common/tensor.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace attnd {

TensorView TensorView::Of(DType dtype, std::initializer_list<int64_t> shape, const void* data,
                          size_t nbytes) {
  TensorView t;
  t.present = true;
  t.dtype = dtype;
  t.rank = static_cast<int>(shape.size());
  int i = 0;
  for (int64_t d : shape) t.dims[i++] = d;
  t.data = data;
  t.nbytes = nbytes;
  return t;
}

int64_t TensorView::num_elements() const {
  int64_t n = 1;
  for (int i = 0; i < rank; ++i) n *= dims[i];
  return n;
}

std::string TensorView::ShapeString() const {
  return absl::StrCat("[", absl::StrJoin(dims, dims + rank, ", "), "]");
}

absl::Status CheckTensor(const char* name, const TensorView& t,
                         std::initializer_list<int64_t> expected) {
  const std::string want = absl::StrCat("[", absl::StrJoin(expected, ", "), "]");
  if (!t.present)
    return absl::InvalidArgumentError(absl::StrCat(name, ": missing; expected shape ", want));
  bool same = t.rank == static_cast<int>(expected.size());
  int i = 0;
  for (int64_t d : expected) same = same && t.dims[i++] == d;
  if (!same)
    return absl::InvalidArgumentError(
        absl::StrCat(name, ": shape ", t.ShapeString(), ", expected ", want));
  for (int j = 0; j < t.rank; ++j)
    if (t.dims[j] < 0) return absl::InvalidArgumentError(absl::StrCat(name, ": negative dim"));
  const size_t bytes = static_cast<size_t>(t.num_elements()) * DTypeSize(t.dtype);
  if (t.nbytes != bytes)
    return absl::InvalidArgumentError(absl::StrCat(name, ": ", t.nbytes, " bytes, expected ", bytes,
                                                   " for ", DTypeName(t.dtype), want));
  if (t.data == nullptr && bytes > 0)
    return absl::InvalidArgumentError(absl::StrCat(name, ": no data"));
  return absl::OkStatus();
}

}  // namespace attnd
