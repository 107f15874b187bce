#include "client/workload.h"

#include <algorithm>
#include <cmath>
#include <numeric>

#include "absl/strings/str_cat.h"
#include "client/attnd_client.h"

namespace attnd::client {

namespace {

v1::Tensor Random(DType dtype, std::vector<int64_t> shape, std::mt19937_64& rng,
                  std::vector<double>* values) {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> f(n);
  for (float& x : f) x = dist(rng);
  std::string bytes(n * DTypeSize(dtype), '\0');
  ConvertFromF32(dtype, f.data(), bytes.data(), n);
  ConvertToF32(dtype, bytes.data(), f.data(), n);
  values->assign(f.begin(), f.end());
  v1::Tensor t;
  t.set_datatype(std::string(DTypeName(dtype)));
  for (int64_t d : shape) t.add_shape(d);
  *t.mutable_data() = std::move(bytes);
  return t;
}

}  // namespace

GeneratedLayer GenerateLayer(const ModelSpec& s, int l, int64_t T, DType dtype, bool write_only,
                             std::mt19937_64& rng) {
  GeneratedLayer g;
  v1::LayerInputs& w = g.wire;
  reference::LayerValues& v = g.values;
  w.set_layer(l);
  const bool full = s.layers[l] == LayerKind::kFull;
  *w.mutable_kv_latent() = Random(dtype, {T, s.kv_lora_rank}, rng, &v.kv_latent);
  *w.mutable_k_rope() = Random(dtype, {T, s.qk_rope_head_dim}, rng, &v.k_rope);
  if (full) *w.mutable_index_k() = Random(dtype, {T, s.index_head_dim}, rng, &v.index_k);
  if (write_only) return g;
  *w.mutable_q_latent() = Random(dtype, {T, s.num_heads, s.kv_lora_rank}, rng, &v.q_latent);
  *w.mutable_q_rope() = Random(dtype, {T, s.num_heads, s.qk_rope_head_dim}, rng, &v.q_rope);
  if (full) {
    *w.mutable_index_q() = Random(dtype, {T, s.index_n_heads, s.index_head_dim}, rng, &v.index_q);
    *w.mutable_index_w() = Random(dtype, {T, s.index_n_heads}, rng, &v.index_w);
  }
  return g;
}

std::vector<GeneratedLayer> GenerateStep(const ModelSpec& s, int64_t T, DType dtype,
                                         bool write_only, std::mt19937_64& rng) {
  std::vector<GeneratedLayer> out;
  out.reserve(s.num_layers());
  for (int l = 0; l < s.num_layers(); ++l)
    out.push_back(GenerateLayer(s, l, T, dtype, write_only, rng));
  return out;
}

double LatencyStats::Percentile(double p) const {
  if (samples_.empty()) return 0;
  std::vector<double> v = samples_;
  std::sort(v.begin(), v.end());
  const double rank = p / 100.0 * (v.size() - 1);
  const size_t lo = static_cast<size_t>(std::floor(rank));
  const size_t hi = std::min(lo + 1, v.size() - 1);
  return v[lo] + (v[hi] - v[lo]) * (rank - lo);
}

double LatencyStats::Sum() const { return std::accumulate(samples_.begin(), samples_.end(), 0.0); }

}  // namespace attnd::client
