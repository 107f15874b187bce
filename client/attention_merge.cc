#include "client/attention_merge.h"

#include <algorithm>
#include <cmath>
#include <limits>

namespace attnd::client {

void MergeAttention(const std::vector<AttentionPart>& parts, int64_t rows, int64_t dim, float* out,
                    float* lse) {
  constexpr double kNegInf = -std::numeric_limits<double>::infinity();
  std::vector<double> acc(static_cast<size_t>(dim)), w(parts.size());
  for (int64_t r = 0; r < rows; ++r) {
    double top = kNegInf;
    bool nan = false;
    for (const AttentionPart& p : parts) {
      const double e = p.lse[r];
      nan |= std::isnan(e);
      top = std::max(top, e);
    }
    double denom = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      const double e = parts[i].lse[r];
      w[i] = e == kNegInf ? 0.0 : std::exp(e - top);
      denom += w[i];
    }
    std::fill(acc.begin(), acc.end(), 0.0);
    for (size_t i = 0; i < parts.size(); ++i) {
      if (w[i] == 0) continue;
      const float* o = parts[i].out + r * dim;
      for (int64_t d = 0; d < dim; ++d) acc[d] += w[i] * o[d];
    }
    float* dst = out + r * dim;
    if (nan) {
      std::fill(dst, dst + dim, std::numeric_limits<float>::quiet_NaN());
      lse[r] = std::numeric_limits<float>::quiet_NaN();
      continue;
    }
    if (!(denom > 0)) {  // no part saw a key
      std::fill(dst, dst + dim, 0.0f);
      lse[r] = -std::numeric_limits<float>::infinity();
      continue;
    }
    for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<float>(acc[d] / denom);
    lse[r] = static_cast<float>(top + std::log(denom));
  }
}

}  // namespace attnd::client
