#include "tests/engine_harness.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "kernels/reference/reference.h"

namespace attnd::testing {

TensorView HostTensor::view() const {
  TensorView t;
  if (!present) return t;
  t.present = true;
  t.dtype = dtype;
  t.rank = static_cast<int>(shape.size());
  for (int i = 0; i < t.rank; ++i) t.dims[i] = shape[i];
  t.data = bytes.data();
  t.nbytes = bytes.size();
  return t;
}

HostTensor RandomTensor(DType dtype, std::vector<int64_t> shape, std::mt19937_64& rng,
                        double scale) {
  HostTensor t;
  t.present = true;
  t.dtype = dtype;
  t.shape = std::move(shape);
  int64_t n = 1;
  for (int64_t d : t.shape) n *= d;
  std::normal_distribution<float> dist(0.0f, static_cast<float>(scale));
  std::vector<float> f(n);
  for (float& x : f) x = dist(rng);
  t.bytes.resize(n * DTypeSize(dtype));
  ConvertFromF32(dtype, f.data(), t.bytes.data(), n);
  ConvertToF32(dtype, t.bytes.data(), f.data(), n);
  t.values.assign(f.begin(), f.end());
  return t;
}

LayerInputs LayerData::inputs() const {
  return LayerInputs{q_latent.view(), q_rope.view(),  kv_latent.view(), k_rope.view(),
                     index_q.view(),  index_k.view(), index_w.view()};
}

double RelL2(const std::vector<double>& a, const std::vector<double>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    num += (a[i] - b[i]) * (a[i] - b[i]);
    den += b[i] * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-300));
}

Harness::Harness(EngineOptions options) {
  auto e = Engine::Create(options);
  if (!e.ok()) {
    ADD_FAILURE() << e.status();
    std::abort();
  }
  engine_ = std::move(e).value();
}

void Harness::Open(const std::string& id) {
  ASSERT_TRUE(engine_->OpenSequence(id).ok());
  History h;
  h.kv.resize(spec().num_layers());
  h.idx.resize(spec().num_layers());
  hist_[id] = std::move(h);
}

void Harness::Fork(const std::string& id, const std::string& parent, int64_t prefix_len) {
  ASSERT_TRUE(engine_->ForkSequence(id, parent, prefix_len).ok());
  const History& p = hist_.at(parent);
  History h;
  h.length = prefix_len;
  for (size_t l = 0; l < p.kv.size(); ++l) {
    h.kv.emplace_back(p.kv[l].begin(), p.kv[l].begin() + prefix_len * spec().latent_dim());
    const size_t ni = p.idx[l].empty() ? 0 : prefix_len * spec().index_head_dim;
    h.idx.emplace_back(p.idx[l].begin(), p.idx[l].begin() + ni);
  }
  hist_[id] = std::move(h);
}

void Harness::Close(const std::string& id) {
  ASSERT_TRUE(engine_->CloseSequence(id).ok());
  hist_.erase(id);
}

int64_t Harness::Length(const std::string& id) const { return hist_.at(id).length; }

std::vector<LayerData> Harness::MakeInputs(const std::vector<StepEntry>& batch, DType dtype,
                                           uint64_t seed) {
  std::mt19937_64 rng(seed);
  const ModelSpec& s = spec();
  int64_t T = 0;
  for (const auto& e : batch) T += e.q_len;
  std::vector<LayerData> out(s.num_layers());
  for (int l = 0; l < s.num_layers(); ++l) {
    LayerData& d = out[l];
    d.q_latent = RandomTensor(dtype, {T, s.num_heads, s.kv_lora_rank}, rng);
    d.q_rope = RandomTensor(dtype, {T, s.num_heads, s.qk_rope_head_dim}, rng);
    d.kv_latent = RandomTensor(dtype, {T, s.kv_lora_rank}, rng);
    d.k_rope = RandomTensor(dtype, {T, s.qk_rope_head_dim}, rng);
    if (s.layers[l] == LayerKind::kFull) {
      d.index_q = RandomTensor(dtype, {T, s.index_n_heads, s.index_head_dim}, rng);
      d.index_k = RandomTensor(dtype, {T, s.index_head_dim}, rng);
      d.index_w = RandomTensor(dtype, {T, s.index_n_heads}, rng);
    }
  }
  return out;
}

Harness::Result Harness::Run(const std::vector<StepEntry>& batch,
                             const std::vector<LayerData>& layers, const StepOptions& options) {
  Result r;
  const ModelSpec& s = spec();
  auto step = engine_->BeginStep(batch, options);
  if (!step.ok()) {
    r.status = step.status();
    return r;
  }
  auto T = engine_->StepTokens(*step);
  r.out.resize(s.num_layers());
  r.traces.resize(s.num_layers());
  for (int l = 0; l < s.num_layers(); ++l) {
    if (options.write_only) {
      LayerInputs in;
      in.kv_latent = layers[l].kv_latent.view();
      in.k_rope = layers[l].k_rope.view();
      in.index_k = layers[l].index_k.view();
      r.status = engine_->RunLayer(*step, l, in, nullptr, 0);
      if (!r.status.ok()) return r;
      continue;
    }
    const DType odt = layers[l].q_latent.dtype;
    const size_t n = static_cast<size_t>(*T) * s.num_heads * s.kv_lora_rank;
    std::vector<uint8_t> out(n * DTypeSize(odt));
    r.status = engine_->RunLayer(*step, l, layers[l].inputs(), out.data(), out.size(), &r.traces[l]);
    if (!r.status.ok()) return r;
    std::vector<float> f(n);
    ConvertToF32(odt, out.data(), f.data(), n);
    r.out[l].assign(f.begin(), f.end());
  }
  // Committed: extend the histories with the keys as the cache stores them.
  const DType ct = engine_->options().cache_dtype;
  int64_t t0 = 0;
  for (const auto& e : batch) {
    History& h = hist_.at(e.sequence_id);
    for (int l = 0; l < s.num_layers(); ++l) {
      const LayerData& d = layers[l];
      for (int64_t j = 0; j < e.q_len; ++j) {
        const int64_t t = t0 + j;
        for (int i = 0; i < s.kv_lora_rank; ++i)
          h.kv[l].push_back(RoundTo(ct, static_cast<float>(d.kv_latent.values[t * s.kv_lora_rank + i])));
        for (int i = 0; i < s.qk_rope_head_dim; ++i)
          h.kv[l].push_back(
              RoundTo(ct, static_cast<float>(d.k_rope.values[t * s.qk_rope_head_dim + i])));
        if (s.layers[l] == LayerKind::kFull)
          for (int i = 0; i < s.index_head_dim; ++i)
            h.idx[l].push_back(
                RoundTo(ct, static_cast<float>(d.index_k.values[t * s.index_head_dim + i])));
      }
    }
    h.length += e.q_len;
    t0 += e.q_len;
  }
  return r;
}

std::vector<std::vector<double>> Harness::Reference(const std::vector<StepEntry>& batch,
                                                    const std::vector<LayerData>& layers,
                                                    const std::vector<LayerTrace>& traces,
                                                    std::vector<LayerCheck>* checks) const {
  const ModelSpec& s = spec();
  const int H = s.num_heads, L = s.kv_lora_rank, R = s.qk_rope_head_dim, D = L + R;
  const int Hi = s.index_n_heads, Di = s.index_head_dim;
  int64_t T = 0;
  for (const auto& e : batch) T += e.q_len;
  std::vector<std::vector<int32_t>> carry(T);
  std::vector<std::vector<double>> out(s.num_layers(), std::vector<double>(T * H * L));
  if (checks) checks->assign(s.num_layers(), LayerCheck{});
  for (int l = 0; l < s.num_layers(); ++l) {
    const LayerData& d = layers[l];
    const LayerKind kind = s.layers[l];
    int64_t t = 0;
    for (const auto& e : batch) {
      const History& h = hist_.at(e.sequence_id);
      const int64_t old_len = h.length - e.q_len;
      for (int64_t j = 0; j < e.q_len; ++j, ++t) {
        const int64_t pos = old_len + j;
        std::vector<double> q(H * D);
        for (int hh = 0; hh < H; ++hh) {
          for (int i = 0; i < L; ++i) q[hh * D + i] = d.q_latent.values[(t * H + hh) * L + i];
          for (int i = 0; i < R; ++i) q[hh * D + L + i] = d.q_rope.values[(t * H + hh) * R + i];
        }
        std::vector<int32_t> keys;
        double cap = 0;
        if (kind == LayerKind::kDense) {
          const int64_t lo = s.sliding_window > 0 ? std::max<int64_t>(0, pos + 1 - s.sliding_window) : 0;
          for (int64_t k = lo; k <= pos; ++k) keys.push_back(static_cast<int32_t>(k));
          cap = s.soft_cap;
        } else if (kind == LayerKind::kShared) {
          keys = carry[t];
        } else {
          const std::vector<double> scores =
              reference::IndexerScores(s, d.index_q.values.data() + t * Hi * Di,
                                       d.index_w.values.data() + t * Hi, h.idx[l].data(), pos + 1);
          keys = reference::SelectKeys(s, scores, s.prefill == PrefillMode::kDense && e.q_len > 1);
          if (!traces.empty() && traces[l].keys[t] != keys) {
            // Accept the engine's choice when it differs only among keys whose float64 scores
            // tie within fp32 rounding.
            const auto& got = traces[l].keys[t];
            std::vector<int32_t> extra, missing;
            std::set_difference(got.begin(), got.end(), keys.begin(), keys.end(),
                                std::back_inserter(extra));
            std::set_difference(keys.begin(), keys.end(), got.begin(), got.end(),
                                std::back_inserter(missing));
            double scale = 0;
            for (double x : scores) scale = std::max(scale, std::abs(x));
            bool ties = s.selection == SelectionMode::kToken && extra.size() == missing.size();
            for (int32_t a : extra)
              for (int32_t b : missing) ties = ties && std::abs(scores[a] - scores[b]) <= 1e-5 * scale;
            if (checks) ++(ties ? (*checks)[l].tie_swaps : (*checks)[l].selection_mismatches);
            if (ties) keys = got;
          }
          carry[t] = keys;
        }
        reference::Attend(s, q.data(), h.kv[l].data(), keys, cap, out[l].data() + t * H * L);
      }
    }
  }
  return out;
}

std::vector<std::vector<double>> Harness::RunAndCheck(const std::vector<StepEntry>& batch,
                                                      DType dtype, uint64_t seed, double tol) {
  const auto layers = MakeInputs(batch, dtype, seed);
  Result r = Run(batch, layers);
  EXPECT_TRUE(r.status.ok()) << r.status;
  if (!r.status.ok()) return {};
  std::vector<LayerCheck> checks;
  const auto ref = Reference(batch, layers, r.traces, &checks);
  for (int l = 0; l < spec().num_layers(); ++l) {
    const double e = RelL2(r.out[l], ref[l]);
    bool nan = false;
    for (double x : r.out[l]) nan |= std::isnan(x);
    EXPECT_FALSE(nan) << "layer " << l;
    EXPECT_LE(e, tol) << "layer " << l << " (" << LayerKindName(spec().layers[l]) << ")";
    EXPECT_EQ(checks[l].selection_mismatches, 0) << "layer " << l;
    worst_ = std::max(worst_, e);
  }
  return r.out;
}

}  // namespace attnd::testing
