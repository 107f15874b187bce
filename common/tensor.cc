#include "common/tensor.h"

#include <algorithm>

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

namespace {

// Index of the first element whose masked exponent bits are all ones (NaN or +-Inf); chunks of
// 256 elements are OR-reduced first so the common all-finite case vectorises.
template <typename U>
int64_t FirstAllOnes(const void* data, int64_t n, U mask) {
  const U* p = static_cast<const U*>(data);
  constexpr int64_t kChunk = 256;
  for (int64_t c = 0; c < n; c += kChunk) {
    const int64_t e = std::min(n, c + kChunk);
    bool hit = false;
    for (int64_t i = c; i < e; ++i) hit |= (p[i] & mask) == mask;
    if (!hit) continue;
    for (int64_t i = c; i < e; ++i)
      if ((p[i] & mask) == mask) return i;
  }
  return -1;
}

}  // namespace

int64_t FirstNonFinite(const TensorView& t) {
  if (!t.present || t.data == nullptr) return -1;
  // Never past the bytes, even for a view whose shape was not checked against them.
  const int64_t n =
      std::min<int64_t>(t.num_elements(), static_cast<int64_t>(t.nbytes / DTypeSize(t.dtype)));
  switch (t.dtype) {
    case DType::kF32:
      return FirstAllOnes<uint32_t>(t.data, n, 0x7f800000u);
    case DType::kBF16:
      return FirstAllOnes<uint16_t>(t.data, n, 0x7f80u);
    case DType::kF16:
      return FirstAllOnes<uint16_t>(t.data, n, 0x7c00u);
    case DType::kFP8E4M3:  // no infinities; 0x7f and 0xff are NaN
      return FirstAllOnes<uint8_t>(t.data, n, 0x7f);
  }
  return -1;
}

absl::Status CheckFinite(const char* name, const TensorView& t) {
  int64_t i = FirstNonFinite(t);
  if (i < 0) return absl::OkStatus();
  const int64_t flat = i;
  int64_t idx[TensorView::kMaxRank] = {0, 0, 0, 0};
  for (int d = t.rank - 1; d >= 0; --d) {
    if (t.dims[d] > 0) {
      idx[d] = i % t.dims[d];
      i /= t.dims[d];
    }
  }
  return absl::InvalidArgumentError(absl::StrCat(name, ": non-finite value (NaN or Inf) at [",
                                                 absl::StrJoin(idx, idx + t.rank, ", "),
                                                 "] (element ", flat, ")"));
}

}  // namespace attnd
