#include "tests/engine_harness.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>

#include "common/fp8.h"
#include "engine/layer_check.h"
#include "kernels/reference/reference.h"
#include "tests/run_layer.h"

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
  if (!scales.empty()) {
    t.scales = scales.data();
    t.scales_nbytes = scales.size() * 4;
    t.scales_per_row = 1;
  }
  return t;
}

HostTensor RandomFp8Query(std::vector<int64_t> shape, std::mt19937_64& rng) {
  HostTensor t;
  t.present = true;
  t.dtype = DType::kFP8E4M3;
  t.shape = std::move(shape);
  int64_t n = 1;
  for (int64_t d : t.shape) n *= d;
  const int64_t elems = t.shape.back(), rows = n / elems;
  std::normal_distribution<float> dist(0.0f, 1.0f);
  t.bytes.resize(n);
  t.values.resize(n);
  t.scales.resize(rows);
  std::vector<float> x(elems);
  for (int64_t r = 0; r < rows; ++r) {
    float amax = 0;
    for (float& v : x) amax = std::max(amax, std::abs(v = dist(rng)));
    const float scale = amax > 0 ? amax / 448.0f : 1.0f;
    t.scales[r] = scale;
    for (int64_t i = 0; i < elems; ++i) {
      const uint8_t code = fp8::F32ToE4M3(x[i] / scale);
      t.bytes[r * elems + i] = code;
      t.values[r * elems + i] = fp8::E4M3ToF32(code) * scale;  // fp32 product, as the server's
    }
  }
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

reference::LayerValues LayerData::values() const {
  return {q_latent.values, q_rope.values,  kv_latent.values, k_rope.values,
          index_q.values,  index_k.values, index_w.values};
}

namespace {
std::vector<std::pair<std::string, int64_t>> Pairs(const std::vector<StepEntry>& batch) {
  std::vector<std::pair<std::string, int64_t>> out;
  for (const auto& e : batch) out.emplace_back(e.sequence_id, e.q_len);
  return out;
}
int64_t Tokens(const std::vector<StepEntry>& batch) {
  int64_t T = 0;
  for (const auto& e : batch) T += e.q_len;
  return T;
}
std::vector<reference::LayerValues> Values(const std::vector<LayerData>& layers) {
  std::vector<reference::LayerValues> out;
  for (const auto& l : layers) out.push_back(l.values());
  return out;
}
}  // namespace

LayerInputs LayerData::inputs() const {
  LayerInputs in;
  in.q_latent = q_latent.view();
  in.q_rope = q_rope.view();
  in.kv_latent = kv_latent.view();
  in.k_rope = k_rope.view();
  in.index_q = index_q.view();
  in.index_k = index_k.view();
  in.index_w = index_w.view();
  return in;
}

EngineOptions TestEngineOptions(ModelSpec spec, int32_t pages, DType cache) {
  EngineOptions o;
  o.spec = std::move(spec);
  o.cache_dtype = cache;
  o.pages_per_device = pages;
  o.threads = 2;
  return o;
}

bool EngineSnapshot::operator==(const EngineSnapshot& o) const {
  if (seqs.size() != o.seqs.size()) return false;
  for (size_t i = 0; i < seqs.size(); ++i)
    if (seqs[i].id != o.seqs[i].id || seqs[i].length != o.seqs[i].length ||
        seqs[i].pages != o.seqs[i].pages || seqs[i].in_step != o.seqs[i].in_step)
      return false;
  return refcounts == o.refcounts && free_pages == o.free_pages && open_steps == o.open_steps;
}

EngineSnapshot TakeSnapshot(Engine& e, const std::vector<std::string>& ids) {
  EngineSnapshot s;
  for (const auto& id : ids) {
    auto info = e.DescribeSequence(id);
    EXPECT_TRUE(info.ok()) << id << ": " << info.status();
    if (info.ok()) s.seqs.push_back(*info);
  }
  s.refcounts = e.PageRefcounts(0);
  s.free_pages = e.Capacity()[0].pages_free;
  s.open_steps = e.num_open_steps();
  return s;
}

Harness::Harness(EngineOptions options) {
  auto e = Engine::Create(options);
  if (!e.ok()) {
    ADD_FAILURE() << e.status();
    std::abort();
  }
  engine_ = std::move(e).value();
  oracle_ = std::make_unique<reference::StepOracle>(engine_->spec(), options.cache_dtype);
}

void Harness::Open(const std::string& id, int device, int64_t import_length) {
  ASSERT_TRUE(engine_->OpenSequence(id, device, import_length).ok());
  oracle_->Open(id);
}

void Harness::OpenStandby(const std::string& id, uint64_t generation) {
  ASSERT_TRUE(engine_->OpenStandby(id, generation).ok());
  oracle_->Open(id);
}

void Harness::Fork(const std::string& id, const std::string& parent, int64_t prefix_len,
                   int device) {
  ASSERT_TRUE(engine_->ForkSequence(id, parent, prefix_len, device).ok());
  oracle_->Fork(id, parent, prefix_len);
}

int64_t Harness::OpenCached(const std::string& id, PrefixQuery prefix, const std::string& donor,
                            int device) {
  auto cached = engine_->OpenSequence(id, device, std::move(prefix));
  EXPECT_TRUE(cached.ok()) << cached.status();
  if (!cached.ok()) return -1;
  if (*cached > 0)
    oracle_->Fork(id, donor, *cached);
  else
    oracle_->Open(id);
  return *cached;
}

void Harness::Close(const std::string& id) {
  ASSERT_TRUE(engine_->CloseSequence(id).ok());
  oracle_->Close(id);
}

int64_t Harness::Length(const std::string& id) const { return oracle_->Length(id); }

std::vector<LayerData> RandomLayers(const ModelSpec& s, int64_t T, DType dtype, uint64_t seed,
                                    bool queries) {
  std::mt19937_64 rng(seed);
  std::vector<LayerData> out(s.num_layers());
  for (int l = 0; l < s.num_layers(); ++l) {
    LayerData& d = out[l];
    const bool fp8 = dtype == DType::kFP8E4M3;
    const DType rest = fp8 ? DType::kBF16 : dtype;
    auto query = [&](std::vector<int64_t> shape) {
      return fp8 ? RandomFp8Query(std::move(shape), rng)
                 : RandomTensor(dtype, std::move(shape), rng);
    };
    if (queries) {
      d.q_latent = query({T, s.num_heads, s.kv_lora_rank});
      d.q_rope = query({T, s.num_heads, s.qk_rope_head_dim});
    }
    d.kv_latent = RandomTensor(rest, {T, s.kv_lora_rank}, rng);
    d.k_rope = RandomTensor(rest, {T, s.qk_rope_head_dim}, rng);
    if (s.layers[l] == LayerKind::kFull) {
      if (queries) d.index_q = query({T, s.index_n_heads, s.index_head_dim});
      d.index_k = RandomTensor(rest, {T, s.index_head_dim}, rng);
      d.index_w = RandomTensor(rest, {T, s.index_n_heads}, rng);
    }
  }
  return out;
}

ModelSpec MixedLayerSpec(SelectionMode mode) {
  ModelSpec s = PresetModelSpec("tiny").value();
  s.layers = {LayerKind::kFull, LayerKind::kShared, LayerKind::kFull, LayerKind::kDense};
  s.index_topk = 24;
  s.selection = mode;
  s.page_union_max_pages = 3;
  s.page_budget = 2;
  s.sliding_window = 40;
  s.soft_cap = 3.0;
  return s;
}

std::vector<LayerData> Harness::MakeInputs(const std::vector<StepEntry>& batch, DType dtype,
                                           uint64_t seed) {
  return RandomLayers(spec(), Tokens(batch), dtype, seed);
}

std::vector<LayerData> Harness::MakeKeys(const std::vector<StepEntry>& batch, DType dtype,
                                         uint64_t seed) {
  return RandomLayers(spec(), Tokens(batch), dtype, seed, /*queries=*/false);
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
  auto T = engine_->DescribeStep(*step)->tokens;
  r.out.resize(s.num_layers());
  r.lse.resize(s.num_layers());
  r.traces.resize(s.num_layers());
  for (int l = 0; l < s.num_layers(); ++l) {
    if (options.write_only) {
      LayerInputs in;
      in.kv_latent = layers[l].kv_latent.view();
      in.k_rope = layers[l].k_rope.view();
      in.index_k = layers[l].index_k.view();
      r.status = RunLayerInto(*engine_, *step, l, in, nullptr, 0);
      if (!r.status.ok()) return r;
      continue;
    }
    const DType odt = OutputDType(layers[l].inputs());
    const size_t n = static_cast<size_t>(T) * s.num_heads * s.kv_lora_rank;
    std::vector<uint8_t> out(n * DTypeSize(odt));
    std::vector<float> lse(static_cast<size_t>(T) * s.num_heads, NAN);
    r.status = RunLayerInto(*engine_, *step, l, layers[l].inputs(), out.data(), out.size(),
                            &r.traces[l], lse.data());
    if (!r.status.ok()) return r;
    std::vector<float> f(n);
    ConvertToF32(odt, out.data(), f.data(), n);
    r.out[l].assign(f.begin(), f.end());
    r.lse[l].assign(lse.begin(), lse.end());
  }
  oracle_->Commit(Pairs(batch), Values(layers));
  return r;
}

std::vector<std::vector<double>> Harness::Reference(const std::vector<StepEntry>& batch,
                                                    const std::vector<LayerData>& layers,
                                                    const std::vector<LayerTrace>& traces,
                                                    std::vector<LayerCheck>* checks,
                                                    std::vector<std::vector<double>>* lse) const {
  std::vector<std::vector<std::vector<int32_t>>> keys;
  for (const auto& t : traces) keys.push_back(t.keys);
  return oracle_->Expected(Pairs(batch), Values(layers), traces.empty() ? nullptr : &keys, checks,
                           lse);
}

std::vector<int> Harness::SelectionsBeyondTies(const std::vector<StepEntry>& batch,
                                               const std::vector<LayerData>& layers,
                                               const std::vector<LayerTrace>& a,
                                               const std::vector<LayerTrace>& b) const {
  std::vector<int> beyond(spec().num_layers(), 0);
  for (const std::vector<LayerTrace>* traces : {&a, &b}) {
    std::vector<LayerCheck> checks;
    Reference(batch, layers, *traces, &checks);
    for (int l = 0; l < spec().num_layers(); ++l) beyond[l] += checks[l].selection_mismatches;
  }
  return beyond;
}

std::vector<std::vector<double>> Harness::RunAndCheck(const std::vector<StepEntry>& batch,
                                                      DType dtype, uint64_t seed, double tol) {
  const auto layers = MakeInputs(batch, dtype, seed);
  Result r = Run(batch, layers);
  EXPECT_TRUE(r.status.ok()) << r.status;
  if (!r.status.ok()) return {};
  std::vector<LayerCheck> checks;
  std::vector<std::vector<double>> ref_lse;
  const auto ref = Reference(batch, layers, r.traces, &checks, &ref_lse);
  for (int l = 0; l < spec().num_layers(); ++l) {
    const double e = RelL2(r.out[l], ref[l]);
    bool nan = false;
    for (double x : r.out[l]) nan |= std::isnan(x);
    EXPECT_FALSE(nan) << "layer " << l;
    int lse_off = 0;  // query heads whose log-sum-exp is off (or NaN)
    for (size_t i = 0; i < ref_lse[l].size(); ++i)
      lse_off += !(std::abs(r.lse[l][i] - ref_lse[l][i]) <= tol * (1 + std::abs(ref_lse[l][i])));
    EXPECT_EQ(lse_off, 0) << "layer " << l << " (" << LayerKindName(spec().layers[l])
                          << "): log-sum-exp";
    EXPECT_LE(e, tol) << "layer " << l << " (" << LayerKindName(spec().layers[l]) << ")";
    EXPECT_EQ(checks[l].selection_mismatches, 0) << "layer " << l;
    worst_ = std::max(worst_, e);
  }
  return r.out;
}

}  // namespace attnd::testing
