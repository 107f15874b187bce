#include "kernels/reference/step_oracle.h"

#include <algorithm>
#include <cmath>
#include <iterator>

#include "common/fp8.h"
#include "kernels/reference/reference.h"

namespace attnd::reference {

double RelL2(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  if (a.size() != b.size()) return INFINITY;
  return std::sqrt(num / std::max(den, 1e-300));
}

StepOracle::StepOracle(ModelSpec spec, DType cache_dtype)
    : spec_(std::move(spec)), cache_dtype_(cache_dtype) {}

void StepOracle::Open(const std::string& id) {
  History h;
  h.kv.resize(spec_.num_layers());
  h.idx.resize(spec_.num_layers());
  hist_[id] = std::move(h);
}

void StepOracle::Fork(const std::string& id, const std::string& parent, int64_t prefix_len) {
  const History& p = hist_.at(parent);
  History h;
  h.length = prefix_len;
  for (size_t l = 0; l < p.kv.size(); ++l) {
    h.kv.emplace_back(p.kv[l].begin(), p.kv[l].begin() + prefix_len * spec_.latent_dim());
    const size_t ni = p.idx[l].empty() ? 0 : prefix_len * spec_.index_head_dim;
    h.idx.emplace_back(p.idx[l].begin(), p.idx[l].begin() + ni);
  }
  hist_[id] = std::move(h);
}

void StepOracle::Close(const std::string& id) { hist_.erase(id); }

int64_t StepOracle::Length(const std::string& id) const { return hist_.at(id).length; }

std::vector<double> StepOracle::Rows(const std::string& id, int layer, int64_t begin,
                                     int64_t end) const {
  const std::vector<double>& kv = hist_.at(id).kv[layer];
  const int64_t D = spec_.kv_lora_rank + spec_.qk_rope_head_dim;
  return std::vector<double>(kv.begin() + begin * D, kv.begin() + end * D);
}

void StepOracle::Commit(const std::vector<std::pair<std::string, int64_t>>& batch,
                        const std::vector<LayerValues>& layers) {
  const ModelSpec& s = spec_;
  const int L = s.kv_lora_rank, R = s.qk_rope_head_dim, Di = s.index_head_dim;
  auto keep = [&](double v) {
    return static_cast<double>(RoundTo(cache_dtype_, static_cast<float>(v)));
  };
  // An fp8 cache holds n values as e4m3 codes times one power-of-two scale per tile: their
  // exact values are what every later read sees.
  const bool fp8 = cache_dtype_ == DType::kFP8E4M3;
  auto keep_fp8 = [](const double* x, int n, int tile, std::vector<double>* out) {
    std::vector<float> f(x, x + n), scales(n / tile);
    std::vector<uint8_t> codes(n);
    fp8::QuantizeTiles(f.data(), n, tile, codes.data(), scales.data());
    for (int i = 0; i < n; ++i)
      out->push_back(static_cast<double>(fp8::E4M3ToF32(codes[i])) * scales[i / tile]);
  };
  int64_t t0 = 0;
  for (const auto& [id, q_len] : batch) {
    History& h = hist_.at(id);
    for (int l = 0; l < s.num_layers(); ++l) {
      const LayerValues& d = layers[l];
      for (int64_t t = t0; t < t0 + q_len; ++t) {
        if (fp8) {
          keep_fp8(d.kv_latent.data() + t * L, L, fp8::LatentTileSize(L), &h.kv[l]);
          for (int i = 0; i < R; ++i)
            h.kv[l].push_back(RoundTo(DType::kBF16, static_cast<float>(d.k_rope[t * R + i])));
          if (s.layers[l] == LayerKind::kFull)
            keep_fp8(d.index_k.data() + t * Di, Di, Di, &h.idx[l]);
          continue;
        }
        for (int i = 0; i < L; ++i) h.kv[l].push_back(keep(d.kv_latent[t * L + i]));
        for (int i = 0; i < R; ++i) h.kv[l].push_back(keep(d.k_rope[t * R + i]));
        if (s.layers[l] == LayerKind::kFull)
          for (int i = 0; i < Di; ++i) h.idx[l].push_back(keep(d.index_k[t * Di + i]));
      }
    }
    h.length += q_len;
    t0 += q_len;
  }
}

std::vector<std::vector<double>> StepOracle::Expected(
    const std::vector<std::pair<std::string, int64_t>>& batch,
    const std::vector<LayerValues>& layers,
    const std::vector<std::vector<std::vector<int32_t>>>* engine_keys,
    std::vector<LayerCheck>* checks, std::vector<std::vector<double>>* lse) const {
  const ModelSpec& s = spec_;
  const int H = s.num_heads, L = s.kv_lora_rank, R = s.qk_rope_head_dim, D = L + R;
  const int Hi = s.index_n_heads, Di = s.index_head_dim;
  int64_t T = 0;
  for (const auto& e : batch) T += e.second;
  std::vector<std::vector<int32_t>> carry(T);
  std::vector<std::vector<double>> out(s.num_layers(), std::vector<double>(T * H * L));
  if (checks) checks->assign(s.num_layers(), LayerCheck{});
  if (lse) lse->assign(s.num_layers(), std::vector<double>(T * H));
  std::vector<double> q(H * D);
  for (int l = 0; l < s.num_layers(); ++l) {
    const LayerValues& d = layers[l];
    const LayerKind kind = s.layers[l];
    int64_t t = 0;
    for (const auto& [id, q_len] : batch) {
      const History& h = hist_.at(id);
      const int64_t old_len = h.length - q_len;
      for (int64_t j = 0; j < q_len; ++j, ++t) {
        const int64_t pos = old_len + j;
        for (int hh = 0; hh < H; ++hh) {
          for (int i = 0; i < L; ++i) q[hh * D + i] = d.q_latent[(t * H + hh) * L + i];
          for (int i = 0; i < R; ++i) q[hh * D + L + i] = d.q_rope[(t * H + hh) * R + i];
        }
        std::vector<int32_t> keys;
        double cap = 0;
        if (kind == LayerKind::kDense) {
          const int64_t lo =
              s.sliding_window > 0 ? std::max<int64_t>(0, pos + 1 - s.sliding_window) : 0;
          for (int64_t k = lo; k <= pos; ++k) keys.push_back(static_cast<int32_t>(k));
          cap = s.soft_cap;
        } else if (kind == LayerKind::kShared) {
          keys = carry[t];
        } else {
          const std::vector<double> scores =
              IndexerScores(s, d.index_q.data() + t * Hi * Di, d.index_w.data() + t * Hi,
                            h.idx[l].data(), pos + 1);
          keys = SelectKeys(s, scores, s.prefill == PrefillMode::kDense && q_len > 1);
          if (engine_keys && (*engine_keys)[l][t] != keys) {
            const auto& got = (*engine_keys)[l][t];
            std::vector<int32_t> extra, missing;
            std::set_difference(got.begin(), got.end(), keys.begin(), keys.end(),
                                std::back_inserter(extra));
            std::set_difference(keys.begin(), keys.end(), got.begin(), got.end(),
                                std::back_inserter(missing));
            double scale = 0;
            for (double x : scores) scale = std::max(scale, std::abs(x));
            bool ties = s.selection == SelectionMode::kToken && extra.size() == missing.size();
            for (int32_t a : extra)
              for (int32_t b : missing)
                ties = ties && a < static_cast<int32_t>(scores.size()) &&
                       std::abs(scores[a] - scores[b]) <= 1e-5 * scale;
            if (checks) ++(ties ? (*checks)[l].tie_swaps : (*checks)[l].selection_mismatches);
            if (ties) keys = got;
          }
          carry[t] = keys;
        }
        Attend(s, q.data(), h.kv[l].data(), keys, cap, out[l].data() + t * H * L,
               lse ? (*lse)[l].data() + t * H : nullptr);
      }
    }
  }
  return out;
}

}  // namespace attnd::reference
