// Server-side absorption (docs/numerics.md): the safetensors reader, the weights' split into W_UK
// and W_UV, loading them from a checkpoint the test writes, and the engine's absorbed calls against
// the float64 reference (q_latent = q_nope · W_UK, attention, out · W_UV^T) and against the
// worker-side path (q_latent sent, W_UV applied by the caller).
#include "common/absorption.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/fp8.h"
#include "common/safetensors.h"
#include "tests/engine_harness.h"
#include "tests/run_layer.h"
#include "tests/temp_dir.h"

namespace attnd::testing {
namespace {

namespace fs = std::filesystem;

struct StTensor {
  std::string name, dtype;
  std::vector<int64_t> shape;
  std::string bytes;
};

std::string Header(const std::vector<StTensor>& ts) {
  std::vector<std::string> entries = {R"("__metadata__":{"format":"pt"})"};
  size_t off = 0;
  for (const StTensor& t : ts) {
    entries.push_back(absl::StrCat("\"", t.name, "\":{\"dtype\":\"", t.dtype, "\",\"shape\":[",
                                   absl::StrJoin(t.shape, ","), "],\"data_offsets\":[", off, ",",
                                   off + t.bytes.size(), "]}"));
    off += t.bytes.size();
  }
  std::string h = absl::StrCat("{", absl::StrJoin(entries, ","), "}");
  while (h.size() % 8) h += ' ';
  return h;
}

// A safetensors file: the header (or `header` verbatim), then the tensors' bytes.
void WriteFile(const std::string& path, const std::vector<StTensor>& ts,
               const std::string* header = nullptr, uint64_t header_len = 0) {
  const std::string h = header ? *header : Header(ts);
  const uint64_t len = header_len ? header_len : h.size();
  std::ofstream f(path, std::ios::binary);
  for (int i = 0; i < 8; ++i) f.put(static_cast<char>(len >> (8 * i)));
  f << h;
  for (const StTensor& t : ts) f << t.bytes;
}

StTensor Encode(const std::string& name, DType dt, std::vector<int64_t> shape,
                const std::vector<float>& v) {
  StTensor t{name, "", std::move(shape), std::string(v.size() * DTypeSize(dt), '\0')};
  t.dtype = dt == DType::kF32    ? "F32"
            : dt == DType::kBF16 ? "BF16"
            : dt == DType::kF16  ? "F16"
                                 : "F8_E4M3";
  if (dt == DType::kFP8E4M3) {
    for (size_t i = 0; i < v.size(); ++i) t.bytes[i] = static_cast<char>(fp8::F32ToE4M3(v[i]));
  } else {
    ConvertFromF32(dt, v.data(), t.bytes.data(), v.size());
  }
  return t;
}

std::vector<float> Random(size_t n, std::mt19937_64& rng, float scale = 0.3f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(n);
  for (float& x : v) x = d(rng);
  return v;
}

std::vector<float> RoundTrip(DType dt, std::vector<float> v) {
  for (float& x : v) x = RoundTo(dt, x);
  return v;
}

void WriteConfig(const std::string& dir, int qk_nope, int v_head, const std::string& extra = "") {
  std::ofstream(dir + "/config.json")
      << "{\"model_type\":\"deepseek_v32\",\"qk_nope_head_dim\":" << qk_nope
      << ",\"v_head_dim\":" << v_head << extra << "}";
}

std::string KvB(int layer) {
  return absl::StrCat("model.layers.", layer, ".self_attn.kv_b_proj.weight");
}

// ---- safetensors ----

TEST(Safetensors, ReadsEveryFloatDtypeAsStored) {
  TempDir dir("attnd-absorb");
  std::mt19937_64 rng(1);
  const std::vector<float> a = Random(6 * 5, rng), b = Random(7, rng), c = Random(12, rng);
  const std::string path = dir.path + "/x.safetensors";
  WriteFile(path, {Encode("a", DType::kF32, {6, 5}, a), Encode("b", DType::kBF16, {7}, b),
                   Encode("c", DType::kF16, {3, 4}, c), Encode("d", DType::kFP8E4M3, {7}, b)});
  auto f = safetensors::File::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  ASSERT_EQ((*f)->tensors().size(), 4u);
  std::vector<float> got;
  ASSERT_TRUE((*f)->ReadF32(*(*f)->Find("a"), &got).ok());
  EXPECT_EQ(got, a);
  EXPECT_EQ((*f)->Find("a")->shape, (std::vector<int64_t>{6, 5}));
  ASSERT_TRUE((*f)->ReadF32(*(*f)->Find("b"), &got).ok());
  EXPECT_EQ(got, RoundTrip(DType::kBF16, b));
  ASSERT_TRUE((*f)->ReadF32(*(*f)->Find("c"), &got).ok());
  EXPECT_EQ(got, RoundTrip(DType::kF16, c));
  ASSERT_TRUE((*f)->ReadF32(*(*f)->Find("d"), &got).ok());
  for (size_t i = 0; i < b.size(); ++i) EXPECT_EQ(got[i], fp8::E4M3ToF32(fp8::F32ToE4M3(b[i])));
  EXPECT_EQ((*f)->Find("e"), nullptr);
}

TEST(Safetensors, RefusesMalformedFilesNamingWhatIsWrong) {
  TempDir dir("attnd-absorb");
  const std::string path = dir.path + "/bad.safetensors";
  const StTensor t = Encode("w", DType::kF32, {2, 2}, {1, 2, 3, 4});
  const auto open_error = [&](const std::string& header, uint64_t len = 0) {
    WriteFile(path, {t}, &header, len);
    auto f = safetensors::File::Open(path);
    EXPECT_FALSE(f.ok());
    return f.ok() ? std::string() : std::string(f.status().message());
  };
  EXPECT_NE(open_error(Header({t}), 1u << 30).find("header length"), std::string::npos);
  EXPECT_NE(open_error(Header({t}), uint64_t{1} << 62).find("header length"), std::string::npos);
  EXPECT_NE(open_error("[1, 2]   ").find("not a JSON object"), std::string::npos);
  EXPECT_NE(open_error("{\"w\": {\"dtype\": \"F32\"}}").find("needs dtype"), std::string::npos);
  EXPECT_NE(open_error(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,999]}})")
                .find("data_offsets"),
            std::string::npos);
  EXPECT_NE(open_error(R"({"w":{"dtype":"F32","shape":[2,2],"data_offsets":[8,4]}})")
                .find("data_offsets"),
            std::string::npos);
  EXPECT_NE(open_error(R"({"w":{"dtype":"F32","shape":[2,3],"data_offsets":[0,16]}})")
                .find("16 bytes for F32 of 6 elements"),
            std::string::npos);
  EXPECT_NE(open_error(R"({"w":{"dtype":"F32","shape":[-2,2],"data_offsets":[0,16]}})")
                .find("bad dimension"),
            std::string::npos);
  // Dimensions whose product overflows 64 bits cannot match the byte range.
  EXPECT_NE(open_error(R"({"w":{"dtype":"F32","shape":[4294967296,4294967296,16],)"
                       R"("data_offsets":[0,16]}})")
                .find("elements"),
            std::string::npos);
  std::ofstream(path) << "abc";
  EXPECT_FALSE(safetensors::File::Open(path).ok());
  EXPECT_EQ(safetensors::File::Open(dir.path + "/none").status().code(),
            absl::StatusCode::kNotFound);
  // A dtype it does not convert is listed but not read.
  WriteFile(path, {StTensor{"i", "I32", {1}, std::string(4, '\1')}});
  auto f = safetensors::File::Open(path);
  ASSERT_TRUE(f.ok()) << f.status();
  std::vector<float> v;
  EXPECT_EQ((*f)->ReadF32(*(*f)->Find("i"), &v).code(), absl::StatusCode::kInvalidArgument);
}

TEST(Safetensors, ShardedCheckpointsFollowTheIndexAndStayInTheirDirectory) {
  TempDir dir("attnd-absorb");
  WriteFile(dir.path + "/a.safetensors", {Encode("x", DType::kF32, {2}, {1, 2})});
  WriteFile(dir.path + "/b.safetensors", {Encode("y", DType::kBF16, {1}, {3})});
  std::ofstream(dir.path + "/model.safetensors.index.json")
      << R"({"metadata":{},"weight_map":{"x":"a.safetensors","y":"b.safetensors",)"
      << R"("z":"b.safetensors"}})";
  auto ck = safetensors::Checkpoint::Open(dir.path);
  ASSERT_TRUE(ck.ok()) << ck.status();
  std::vector<int64_t> shape;
  std::vector<float> v;
  ASSERT_TRUE((*ck)->ReadF32("y", &shape, &v).ok());
  EXPECT_EQ(v, std::vector<float>{3});
  ASSERT_TRUE((*ck)->ReadF32("x", &shape, &v).ok());
  EXPECT_EQ(v, (std::vector<float>{1, 2}));
  EXPECT_EQ((*ck)->ReadF32("w", &shape, &v).code(), absl::StatusCode::kNotFound);
  // Listed by the index but not in its shard.
  EXPECT_EQ((*ck)->ReadF32("z", &shape, &v).code(), absl::StatusCode::kInvalidArgument);
  for (const char* bad : {"../a.safetensors", "/etc/passwd", "..", "sub/a.safetensors"}) {
    std::ofstream(dir.path + "/model.safetensors.index.json")
        << R"({"weight_map":{"x":")" << bad << R"("}})";
    auto c = safetensors::Checkpoint::Open(dir.path);
    ASSERT_FALSE(c.ok()) << bad;
    EXPECT_NE(c.status().message().find("not a file of this directory"), std::string::npos);
  }
  fs::remove(dir.path + "/model.safetensors.index.json");
  EXPECT_EQ(safetensors::Checkpoint::Open(dir.path).status().code(), absl::StatusCode::kNotFound);
}

// ---- the weights ----

ModelSpec Spec() {
  ModelSpec s = MixedLayerSpec(SelectionMode::kToken);
  s.name = "absorb";
  return s;
}

// Random kv_b_proj weights [H*(Dn+V), L] per layer.
std::vector<std::vector<float>> RandomKvB(const ModelSpec& s, int dn, int v, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::vector<std::vector<float>> w;
  for (int l = 0; l < s.num_layers(); ++l)
    w.push_back(Random(static_cast<size_t>(s.num_heads) * (dn + v) * s.kv_lora_rank, rng));
  return w;
}

std::shared_ptr<const Absorption> Make(const ModelSpec& s, int dn, int v,
                                       const std::vector<std::vector<float>>& kv_b) {
  auto a = Absorption::Create(s, dn, v, "test").value();
  for (int l = 0; l < s.num_layers(); ++l) {
    const absl::Status st =
        a->SetLayer(l, {int64_t{s.num_heads} * (dn + v), s.kv_lora_rank}, kv_b[l].data());
    EXPECT_TRUE(st.ok()) << st;
  }
  return std::shared_ptr<const Absorption>(std::move(a));
}

TEST(Absorption, SplitsKvBPerHeadIntoUkAndTransposedUv) {
  const ModelSpec s = Spec();
  const int dn = 5, v = 3, L = s.kv_lora_rank;
  const auto kv_b = RandomKvB(s, dn, v, 2);
  const auto a = Make(s, dn, v, kv_b);
  for (int l : {0, 3})
    for (int h = 0; h < s.num_heads; ++h)
      for (int r = 0; r < dn + v; ++r)
        for (int c = 0; c < L; ++c) {
          const float want = kv_b[l][(static_cast<size_t>(h) * (dn + v) + r) * L + c];
          const float got = r < dn ? a->Uk(l, h)[r * L + c] : a->UvT(l, h)[c * v + (r - dn)];
          ASSERT_EQ(got, want) << l << " " << h << " " << r << " " << c;
        }
  EXPECT_EQ(a->bytes(), 4u * s.num_layers() * s.num_heads * (dn + v) * L);
  EXPECT_TRUE(a->SameAs(*Make(s, dn, v, kv_b)));
  EXPECT_FALSE(a->SameAs(*Make(s, dn, v, RandomKvB(s, dn, v, 3))));
}

TEST(Absorption, RefusesWrongShapesNonFiniteValuesAndMissingLayers) {
  const ModelSpec s = Spec();
  auto a = Absorption::Create(s, 4, 4, "test").value();
  std::vector<float> w(static_cast<size_t>(s.num_heads) * 8 * s.kv_lora_rank, 0.5f);
  EXPECT_EQ(a->SetLayer(0, {s.num_heads * 8 - 1, s.kv_lora_rank}, w.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(a->SetLayer(0, {int64_t{s.num_heads} * 8}, w.data()).code(),
            absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(a->SetLayer(9, {s.num_heads * 8, s.kv_lora_rank}, w.data()).code(),
            absl::StatusCode::kOutOfRange);
  w[17] = NAN;
  const absl::Status nan = a->SetLayer(0, {s.num_heads * 8, s.kv_lora_rank}, w.data());
  EXPECT_EQ(nan.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(nan.message().find("nan"), std::string::npos) << nan;
  w[17] = 1;
  ASSERT_TRUE(a->SetLayer(0, {s.num_heads * 8, s.kv_lora_rank}, w.data()).ok());
  EXPECT_EQ(a->missing_layer(), 1);
  EXPECT_FALSE(a->complete());
  EXPECT_FALSE(Absorption::Create(s, 0, 4, "t").ok());
  EXPECT_FALSE(Absorption::Create(s, 4, 5000, "t").ok());
  // An engine refuses incomplete weights, and weights of another model.
  EngineOptions o;
  o.spec = s;
  o.pages_per_device = 64;
  o.threads = 1;
  o.absorption = std::shared_ptr<const Absorption>(std::move(a));
  auto e = Engine::Create(o);
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(e.status().message().find("layer 1 is missing"), std::string::npos) << e.status();
  ModelSpec other = s;
  other.num_heads = 8;
  o.absorption = Make(other, 4, 4, RandomKvB(other, 4, 4, 1));
  EXPECT_EQ(Engine::Create(o).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Absorption, LoadsOnlyKvBProjFromACheckpointInEveryDtype) {
  const ModelSpec s = Spec();
  const int dn = 6, v = 4, rows = s.num_heads * (dn + v), L = s.kv_lora_rank;
  const auto kv_b = RandomKvB(s, dn, v, 4);
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    TempDir dir("attnd-absorb");
    WriteConfig(dir.path, dn, v);
    // Two shards; other tensors around the ones read; layer 3 in the second shard.
    std::vector<StTensor> a, b;
    for (int l = 0; l < 3; ++l) {
      a.push_back(Encode(absl::StrCat("model.layers.", l, ".self_attn.q_b_proj.weight"), dt, {2, 2},
                         {1, 2, 3, 4}));
      a.push_back(Encode(KvB(l), dt, {rows, L}, kv_b[l]));
    }
    b.push_back(Encode(KvB(3), dt, {rows, L}, kv_b[3]));
    WriteFile(dir.path + "/model-00001-of-00002.safetensors", a);
    WriteFile(dir.path + "/model-00002-of-00002.safetensors", b);
    std::string map;
    for (const auto& t : a)
      absl::StrAppend(&map, "\"", t.name, "\":\"model-00001-of-00002.safetensors\",");
    absl::StrAppend(&map, "\"", KvB(3), "\":\"model-00002-of-00002.safetensors\"");
    std::ofstream(dir.path + "/model.safetensors.index.json") << "{\"weight_map\":{" << map << "}}";
    auto got = LoadAbsorption(dir.path, s);
    ASSERT_TRUE(got.ok()) << got.status();
    std::vector<std::vector<float>> want;
    for (const auto& w : kv_b) want.push_back(RoundTrip(dt, w));
    EXPECT_TRUE((*got)->SameAs(*Make(s, dn, v, want))) << DTypeName(dt);
    EXPECT_EQ((*got)->source(), "checkpoint " + dir.path);
  }
}

TEST(Absorption, DequantisesFp8CheckpointsWithTheirScaleBlocks) {
  const ModelSpec s = Spec();
  const int dn = 6, v = 4, rows = s.num_heads * (dn + v), L = s.kv_lora_rank;  // [40, 32]
  const auto kv_b = RandomKvB(s, dn, v, 5);
  TempDir dir("attnd-absorb");
  WriteConfig(dir.path, dn, v, ",\"quantization_config\":{\"weight_block_size\":[16,8]}");
  std::vector<StTensor> ts;
  std::vector<std::vector<float>> want;
  const int sr = (rows + 15) / 16, sc = L / 8;
  for (int l = 0; l < s.num_layers(); ++l) {
    std::vector<float> scale(sr * sc);
    for (int i = 0; i < sr * sc; ++i) scale[i] = 0.01f * (1 + i % 7);
    std::vector<float> codes(kv_b[l].size()), w(kv_b[l].size());
    for (int i = 0; i < rows; ++i)
      for (int j = 0; j < L; ++j) {
        const float sv = scale[(i / 16) * sc + j / 8];
        const uint8_t c = fp8::F32ToE4M3(kv_b[l][i * L + j] / sv);
        codes[i * L + j] = fp8::E4M3ToF32(c);
        w[i * L + j] = fp8::E4M3ToF32(c) * sv;
      }
    ts.push_back(Encode(KvB(l), DType::kFP8E4M3, {rows, L}, codes));
    ts.push_back(Encode(KvB(l) + "_scale_inv", DType::kF32, {sr, sc}, scale));
    want.push_back(w);
  }
  WriteFile(dir.path + "/model.safetensors", ts);
  auto got = LoadAbsorption(dir.path, s);
  ASSERT_TRUE(got.ok()) << got.status();
  EXPECT_TRUE((*got)->SameAs(*Make(s, dn, v, want)));
  // Without its scales, or with scales of the wrong block shape: refused, naming the tensor.
  ts.erase(ts.begin() + 1);
  WriteFile(dir.path + "/model.safetensors", ts);
  auto missing = LoadAbsorption(dir.path, s);
  ASSERT_FALSE(missing.ok());
  EXPECT_NE(missing.status().message().find("_scale_inv"), std::string::npos);
}

TEST(Absorption, CheckpointErrorsNameTheFileAndTensor) {
  const ModelSpec s = Spec();
  TempDir dir("attnd-absorb");
  EXPECT_EQ(LoadAbsorption(dir.path, s).status().code(), absl::StatusCode::kNotFound);
  WriteConfig(dir.path, 6, 4);
  const auto kv_b = RandomKvB(s, 6, 4, 6);
  std::vector<StTensor> ts;
  for (int l = 0; l < 3; ++l)  // layer 3 missing
    ts.push_back(Encode(KvB(l), DType::kF32, {s.num_heads * 10, s.kv_lora_rank}, kv_b[l]));
  WriteFile(dir.path + "/model.safetensors", ts);
  auto r = LoadAbsorption(dir.path, s);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find(KvB(3)), std::string::npos) << r.status();
  // A checkpoint of other dims (config says Dn 7): the shape check names the layer.
  WriteConfig(dir.path, 7, 4);
  r = LoadAbsorption(dir.path, s);
  ASSERT_FALSE(r.ok());
  EXPECT_NE(r.status().message().find("layer 0's kv_b_proj.weight must be"), std::string::npos)
      << r.status();
}

// ---- the engine's absorbed calls ----

struct Absorbed {
  std::vector<double> out;  // [T, H, V]
  std::vector<double> lse;  // [T, H]
  LayerTrace trace;
};

// q_latent[t, h] = q_nope[t, h] · W_UK[h] in float64.
std::vector<double> Absorb64(const Absorption& a, int layer, const std::vector<double>& qn,
                             int64_t T) {
  const int H = a.num_heads(), Dn = a.qk_nope_head_dim(), L = a.latent_dim();
  std::vector<double> q(static_cast<size_t>(T) * H * L, 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h)
      for (int d = 0; d < Dn; ++d)
        for (int l = 0; l < L; ++l)
          q[(t * H + h) * L + l] += qn[(t * H + h) * Dn + d] * a.Uk(layer, h)[d * L + l];
  return q;
}

// v[t, h] = out[t, h] · W_UV[h]^T in float64.
std::vector<double> Values64(const Absorption& a, int layer, const std::vector<double>& out,
                             int64_t T) {
  const int H = a.num_heads(), V = a.v_head_dim(), L = a.latent_dim();
  std::vector<double> v(static_cast<size_t>(T) * H * V, 0.0);
  for (int64_t t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h)
      for (int l = 0; l < L; ++l)
        for (int j = 0; j < V; ++j)
          v[(t * H + h) * V + j] += out[(t * H + h) * L + l] * a.UvT(layer, h)[l * V + j];
  return v;
}

std::vector<double> ToDoubles(DType dt, const std::vector<uint8_t>& bytes) {
  const size_t n = bytes.size() / DTypeSize(dt);
  std::vector<float> f(n);
  ConvertToF32(dt, bytes.data(), f.data(), n);
  return {f.begin(), f.end()};
}

class EngineAbsorption
    : public ::testing::TestWithParam<std::tuple<DType, SelectionMode, int, int, int>> {};

// Prefill, a mixed extend + decode batch, then decodes past K: every layer kind, its output
// [T, H, V] and lse against float64 over the absorbed query; selections as the oracle's.
TEST_P(EngineAbsorption, MatchesTheFloat64ReferenceOnEveryLayerKind) {
  const auto [dtype, mode, dn, v, devices] = GetParam();
  ModelSpec s = MixedLayerSpec(mode);
  s.name = "absorb";
  const auto absorb = Make(s, dn, v, RandomKvB(s, dn, v, 7));
  EngineOptions o;
  o.spec = s;
  o.cache_dtype = dtype == DType::kF32 ? DType::kF32 : DType::kBF16;
  o.pages_per_device = 256;
  o.num_devices = devices;
  o.threads = 2;
  o.absorption = absorb;
  auto engine = Engine::Create(o).value();
  reference::StepOracle oracle(s, o.cache_dtype);
  for (const char* id : {"a", "b", "c"}) {
    ASSERT_TRUE(engine->OpenSequence(id).ok());
    oracle.Open(id);
  }
  const double tol = dtype == DType::kF32 ? 1e-5 : 1e-2;
  const int H = s.num_heads;
  double worst = 0;
  uint64_t seed = 50;
  const std::vector<std::vector<std::pair<std::string, int64_t>>> steps = {
      {{"a", 37}, {"b", 16}, {"c", 5}},
      {{"a", 1}, {"b", 30}, {"c", 1}},
      {{"c", 1}, {"a", 1}},
      {{"a", 1}, {"b", 1}, {"c", 1}}};
  for (const auto& batch : steps) {
    int64_t T = 0;
    std::vector<StepEntry> entries;
    for (const auto& [id, n] : batch) {
      T += n;
      entries.push_back({id, n});
    }
    std::vector<LayerData> layers = RandomLayers(s, T, dtype, seed++);
    std::mt19937_64 rng(seed++);
    const uint64_t step = engine->BeginStep(entries).value();
    std::vector<reference::LayerValues> values;
    std::vector<Absorbed> got(s.num_layers());
    std::vector<std::vector<std::vector<int32_t>>> keys;
    for (int l = 0; l < s.num_layers(); ++l) {
      const HostTensor qn = RandomTensor(dtype, {T, H, dn}, rng);
      LayerInputs in = layers[l].inputs();
      in.q_latent = {};
      in.q_nope = qn.view();
      const DType out_t = dtype;
      std::vector<uint8_t> out(static_cast<size_t>(T) * H * v * DTypeSize(out_t));
      std::vector<float> lse(static_cast<size_t>(T) * H);
      const absl::Status r =
          RunLayerInto(*engine, step, l, in, out.data(), out.size(), &got[l].trace, lse.data());
      ASSERT_TRUE(r.ok()) << r;
      got[l].out = ToDoubles(out_t, out);
      got[l].lse.assign(lse.begin(), lse.end());
      reference::LayerValues lv = layers[l].values();
      lv.q_latent = Absorb64(*absorb, l, qn.values, T);
      values.push_back(std::move(lv));
      keys.push_back(got[l].trace.keys);
    }
    oracle.Commit(batch, values);
    std::vector<LayerCheck> checks;
    std::vector<std::vector<double>> lse64;
    const auto expected = oracle.Expected(batch, values, &keys, &checks, &lse64);
    for (int l = 0; l < s.num_layers(); ++l) {
      EXPECT_EQ(checks[l].selection_mismatches, 0) << "layer " << l;
      const std::vector<double> want = Values64(*absorb, l, expected[l], T);
      for (double x : got[l].out) ASSERT_FALSE(std::isnan(x));
      const double err = RelL2(got[l].out, want);
      EXPECT_LE(err, tol) << "layer " << l;
      worst = std::max(worst, err);
      for (size_t i = 0; i < lse64[l].size(); ++i)
        ASSERT_NEAR(got[l].lse[i], lse64[l][i],
                    (dtype == DType::kF32 ? 1e-5 : 2e-2) * (1 + std::abs(lse64[l][i])))
            << "layer " << l << " row " << i;
    }
  }
  EXPECT_GT(worst, 0.0);  // the comparison is live
}

INSTANTIATE_TEST_SUITE_P(
    Sweep, EngineAbsorption,
    ::testing::Values(std::make_tuple(DType::kF32, SelectionMode::kToken, 24, 20, 1),
                      std::make_tuple(DType::kF32, SelectionMode::kPageUnion, 16, 32, 2),
                      std::make_tuple(DType::kF32, SelectionMode::kPageBudget, 8, 40, 1),
                      std::make_tuple(DType::kBF16, SelectionMode::kToken, 32, 48, 1),
                      std::make_tuple(DType::kBF16, SelectionMode::kToken, 16, 16, 2)));

// The absorbed call equals the worker-side path on the same inputs: q_latent = q_nope · W_UK in
// fp32 sent as FP32, the latent output times W_UV^T in fp32 (<= 1e-5 relative L2).
TEST(EngineAbsorption, EqualsTheWorkerSideAbsorption) {
  const ModelSpec s = Spec();
  const int dn = 24, v = 20, H = s.num_heads, L = s.kv_lora_rank;
  const auto absorb = Make(s, dn, v, RandomKvB(s, dn, v, 8));
  EngineOptions o;
  o.spec = s;
  o.cache_dtype = DType::kF32;
  o.pages_per_device = 256;
  o.threads = 2;
  auto worker = Engine::Create(o).value();
  o.absorption = absorb;
  auto server = Engine::Create(o).value();
  ASSERT_TRUE(worker->OpenSequence("x").ok());
  ASSERT_TRUE(server->OpenSequence("x").ok());
  uint64_t seed = 90;
  for (int64_t T : {40, 1, 1, 3}) {
    const auto layers = RandomLayers(s, T, DType::kF32, seed++);
    std::mt19937_64 rng(seed++);
    const uint64_t a = worker->BeginStep({{"x", T}}).value();
    const uint64_t b = server->BeginStep({{"x", T}}).value();
    for (int l = 0; l < s.num_layers(); ++l) {
      const HostTensor qn = RandomTensor(DType::kF32, {T, H, dn}, rng);
      std::vector<float> ql(static_cast<size_t>(T) * H * L, 0.0f);  // the worker's fp32 einsum
      for (int64_t t = 0; t < T; ++t)
        for (int h = 0; h < H; ++h)
          for (int d = 0; d < dn; ++d)
            for (int j = 0; j < L; ++j)
              ql[(t * H + h) * L + j] +=
                  static_cast<float>(qn.values[(t * H + h) * dn + d]) * absorb->Uk(l, h)[d * L + j];
      LayerInputs in = layers[l].inputs();
      in.q_latent = TensorView::Of(DType::kF32, {T, H, L}, ql.data(), ql.size() * 4);
      std::vector<float> lat(static_cast<size_t>(T) * H * L);
      ASSERT_TRUE(RunLayerInto(*worker, a, l, in, lat.data(), lat.size() * 4).ok());
      std::vector<double> want(static_cast<size_t>(T) * H * v, 0.0);
      for (int64_t t = 0; t < T; ++t)
        for (int h = 0; h < H; ++h)
          for (int j = 0; j < v; ++j) {
            float acc = 0;
            for (int k = 0; k < L; ++k)
              acc += lat[(t * H + h) * L + k] * absorb->UvT(l, h)[k * v + j];
            want[(t * H + h) * v + j] = acc;
          }
      in.q_latent = {};
      in.q_nope = qn.view();
      std::vector<float> out(static_cast<size_t>(T) * H * v);
      const absl::Status r = RunLayerInto(*server, b, l, in, out.data(), out.size() * 4);
      ASSERT_TRUE(r.ok()) << r;
      EXPECT_LE(RelL2(std::vector<double>(out.begin(), out.end()), want), 1e-5) << l;
    }
  }
}

TEST(EngineAbsorption, RefusesBadAbsorbedCallsPreciselyAndKeepsTheSequence) {
  const ModelSpec s = Spec();
  const int dn = 8, v = 12, H = s.num_heads;
  EngineOptions o;
  o.spec = s;
  o.cache_dtype = DType::kF32;
  o.pages_per_device = 64;
  o.threads = 1;
  auto plain = Engine::Create(o).value();
  ASSERT_TRUE(plain->OpenSequence("x").ok());
  const auto layers = RandomLayers(s, 3, DType::kF32, 1);
  std::mt19937_64 rng(2);
  const HostTensor qn = RandomTensor(DType::kF32, {3, H, dn}, rng);
  std::vector<float> out(3 * H * v);
  LayerInputs in = layers[0].inputs();
  in.q_latent = {};
  in.q_nope = qn.view();
  uint64_t step = plain->BeginStep({{"x", 3}}).value();
  absl::Status r = RunLayerInto(*plain, step, 0, in, out.data(), out.size() * 4);
  EXPECT_EQ(r.code(), absl::StatusCode::kFailedPrecondition) << r;
  EXPECT_NE(r.message().find("no absorption weights"), std::string::npos) << r;
  EXPECT_EQ(plain->DescribeSequence("x")->length, 0);

  // Weights set later (an upload): then the same call runs; again the same weights is a no-op,
  // different ones ALREADY_EXISTS.
  const auto absorb = Make(s, dn, v, RandomKvB(s, dn, v, 3));
  ASSERT_TRUE(plain->SetAbsorption(absorb).ok());
  EXPECT_TRUE(plain->SetAbsorption(Make(s, dn, v, RandomKvB(s, dn, v, 3))).ok());
  EXPECT_EQ(plain->SetAbsorption(Make(s, dn, v, RandomKvB(s, dn, v, 4))).code(),
            absl::StatusCode::kAlreadyExists);
  EXPECT_EQ(plain->absorption(), absorb);

  const auto run = [&](const LayerInputs& call, size_t bytes) {
    const uint64_t id = plain->BeginStep({{"x", 3}}).value();
    std::vector<uint8_t> buf(bytes);
    return RunLayerInto(*plain, id, 0, call, buf.data(), buf.size());
  };
  const size_t v_bytes = 3 * H * v * 4;
  LayerInputs both = in;
  both.q_latent = layers[0].q_latent.view();
  r = run(both, v_bytes);
  EXPECT_EQ(r.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.message().find("give one"), std::string::npos) << r;
  const HostTensor wrong = RandomTensor(DType::kF32, {3, H, dn + 1}, rng);
  LayerInputs bad = in;
  bad.q_nope = wrong.view();
  r = run(bad, v_bytes);
  EXPECT_EQ(r.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.message().find("q_nope"), std::string::npos) << r;
  r = run(in, 3 * H * s.kv_lora_rank * 4);  // a latent-sized output buffer
  EXPECT_EQ(r.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(r.message().find("[T, H, V]"), std::string::npos) << r;
  EXPECT_EQ(plain->DescribeSequence("x")->length, 0);  // every failed step left it as it was
  // And the well-formed call commits.
  step = plain->BeginStep({{"x", 3}}).value();
  for (int l = 0; l < s.num_layers(); ++l) {
    LayerInputs li = layers[l].inputs();
    li.q_latent = {};
    li.q_nope = qn.view();
    ASSERT_TRUE(RunLayerInto(*plain, step, l, li, out.data(), out.size() * 4).ok());
  }
  EXPECT_EQ(plain->DescribeSequence("x")->length, 3);
}

}  // namespace
}  // namespace attnd::testing
