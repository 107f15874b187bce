// What a GPU layer call packs, uploads and downloads (kernels/cuda/backend/layer_upload.h), checked
// on the host: which tensors each kind of call carries, that sections are aligned, disjoint and in
// the order the GPU consumes them, that every packed row is the request's row for its share
// token (and an fp8 cache's row the host quantiser's bytes), that outputs land on their share
// rows only, and that BeginStep's bound covers every call.
#include "kernels/cuda/backend/layer_upload.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <vector>

#include "common/absorption.h"
#include "common/fp8.h"
#include "kernels/fp8_rows.h"

namespace attnd::cuda {
namespace {

ModelSpec Tiny() { return PresetModelSpec("tiny").value(); }  // layers full/shared/full/shared

// A tensor of random bytes (values in range for its dtype) that a view points at.
struct Owned {
  std::vector<uint8_t> bytes, scales;
  TensorView view;
};

Owned Random(DType dtype, std::vector<int64_t> shape, std::mt19937& rng, int64_t scale_heads = 0) {
  Owned t;
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  std::vector<float> v(n);
  std::normal_distribution<float> dist(0, 1);
  for (float& x : v) x = dist(rng);
  t.bytes.resize(n * DTypeSize(dtype));
  if (dtype == DType::kFP8E4M3) {
    for (int64_t i = 0; i < n; ++i) t.bytes[i] = fp8::F32ToE4M3(v[i]);
  } else {
    ConvertFromF32(dtype, v.data(), t.bytes.data(), n);
  }
  t.view.present = true;
  t.view.dtype = dtype;
  t.view.rank = static_cast<int>(shape.size());
  for (size_t i = 0; i < shape.size(); ++i) t.view.dims[i] = shape[i];
  t.view.data = t.bytes.data();
  t.view.nbytes = t.bytes.size();
  if (dtype == DType::kFP8E4M3) {  // one fp32 scale per token and head (queries)
    const int64_t count = shape[0] * scale_heads;
    std::vector<float> sc(count);
    for (float& x : sc) x = 0.5f + std::uniform_real_distribution<float>(0, 1)(rng);
    t.scales.resize(count * 4);
    std::memcpy(t.scales.data(), sc.data(), t.scales.size());
    t.view.scales = t.scales.data();
    t.view.scales_nbytes = t.scales.size();
    t.view.scales_per_row = 1;
  }
  return t;
}

// A step of T tokens whose share is `rows` (a device's tokens, not all consecutive).
struct Fixture {
  ModelSpec spec = Tiny();
  int64_t T = 9;
  std::vector<int64_t> rows = {7, 0, 1, 2, 5};
  std::mt19937 rng{17};
  Owned q_latent, q_nope, q_rope, kv_latent, k_rope, index_q, index_k, index_w;
  LayerInputs in;
  StepShare share;

  explicit Fixture(DType dtype, DType query_dtype = DType::kBF16, int dn = 0) {
    const int H = spec.num_heads, L = spec.kv_lora_rank, R = spec.qk_rope_head_dim;
    const int Hi = spec.index_n_heads, Di = spec.index_head_dim;
    q_latent = Random(query_dtype, {T, H, L}, rng, H);
    if (dn > 0) q_nope = Random(query_dtype, {T, H, dn}, rng, H);
    q_rope = Random(query_dtype, {T, H, R}, rng, H);
    kv_latent = Random(dtype, {T, L}, rng);
    k_rope = Random(dtype, {T, R}, rng);
    index_q = Random(query_dtype, {T, Hi, Di}, rng, Hi);
    index_k = Random(dtype, {T, Di}, rng);
    index_w = Random(dtype, {T, Hi}, rng);
    in.q_latent = q_latent.view;
    in.q_nope = q_nope.view;
    in.q_rope = q_rope.view;
    in.kv_latent = kv_latent.view;
    in.k_rope = k_rope.view;
    in.index_q = index_q.view;
    in.index_k = index_k.view;
    in.index_w = index_w.view;
    share.rows = rows;
  }
  LayerCall Call(int layer, uint8_t* out, float* lse = nullptr) const {
    LayerCall c;
    c.layer = layer;
    c.in = &in;
    c.select = spec.layers[layer] == LayerKind::kFull;
    c.out_dtype = DType::kBF16;
    c.out = out;
    c.lse = lse;
    return c;
  }
};

// Every present section: aligned, inside its part, disjoint from the others, in the given order.
void ExpectLaidOut(const LayerUpload& p, const std::vector<const UploadSection*>& keys,
                   const std::vector<const UploadSection*>& queries,
                   const std::vector<const UploadSection*>& outputs) {
  size_t end = 0;
  auto walk = [&](const std::vector<const UploadSection*>& part, size_t limit, const char* what) {
    for (const UploadSection* s : part) {
      if (!s->present()) continue;
      EXPECT_EQ(s->offset % kUploadAlign, 0u) << what;
      EXPECT_GE(s->offset, end) << what << ": overlaps the section before it";
      end = s->offset + s->bytes;
      EXPECT_LE(end, limit) << what << ": past its part";
    }
  };
  walk(keys, p.keys_bytes, "key part");
  walk(queries, p.input_bytes, "query part");
  EXPECT_EQ(p.output_offset() % kUploadAlign, 0u);
  end = std::max(end, p.output_offset());
  walk(outputs, p.total_bytes, "output part");
  EXPECT_EQ(p.output_offset() + p.output_bytes(), p.total_bytes);
}

// Section rows i = tensor row rows[i] (row_bytes each).
void ExpectRows(const uint8_t* buffer, const UploadSection& s, const void* src, size_t row_bytes,
                const std::vector<int64_t>& rows, const char* what) {
  ASSERT_EQ(s.bytes, rows.size() * row_bytes) << what;
  for (size_t i = 0; i < rows.size(); ++i)
    EXPECT_EQ(std::memcmp(buffer + s.offset + i * row_bytes,
                          static_cast<const uint8_t*>(src) + rows[i] * row_bytes, row_bytes),
              0)
        << what << " row " << i;
}

TEST(LayerUpload, AFullLayerCarriesKeysIndexerInputsAndQueriesInThatOrder) {
  Fixture f(DType::kBF16);
  const ModelSpec& s = f.spec;
  const CacheLayout layout = CacheLayout::ForModel(s, DType::kBF16, 16);
  std::vector<uint8_t> out(f.T * s.num_heads * s.kv_lora_rank * 2);
  std::vector<float> lse(f.T * s.num_heads);
  const LayerCall call = f.Call(0, out.data(), lse.data());
  const LayerUpload p = PlanLayerUpload(s, layout, f.share.size(), call, NeedsOf(call));
  ExpectLaidOut(
      p, {&p.kv_latent.rows, &p.k_rope.rows, &p.index_k.rows, &p.index_q.rows, &p.index_w.rows},
      {&p.query.rows, &p.q_rope.rows}, {&p.out, &p.lse});
  for (const UploadSection* sec :
       {&p.kv_latent.rows, &p.k_rope.rows, &p.index_k.rows, &p.index_q.rows, &p.index_w.rows,
        &p.query.rows, &p.q_rope.rows, &p.out, &p.lse})
    EXPECT_TRUE(sec->present());
  EXPECT_FALSE(p.latent_rows.present());
  EXPECT_FALSE(p.query.scales.present());
  EXPECT_EQ(p.out.bytes, f.rows.size() * s.num_heads * s.kv_lora_rank * 2);
  EXPECT_EQ(p.lse.bytes, f.rows.size() * s.num_heads * 4);

  std::vector<uint8_t> buffer(p.total_bytes, 0xee);
  PackLayerUpload(p, f.share, call, s, layout, buffer.data());
  const int H = s.num_heads, L = s.kv_lora_rank, R = s.qk_rope_head_dim;
  const int Hi = s.index_n_heads, Di = s.index_head_dim;
  ExpectRows(buffer.data(), p.kv_latent.rows, f.kv_latent.bytes.data(), L * 2, f.rows, "kv_latent");
  ExpectRows(buffer.data(), p.k_rope.rows, f.k_rope.bytes.data(), R * 2, f.rows, "k_rope");
  ExpectRows(buffer.data(), p.index_k.rows, f.index_k.bytes.data(), Di * 2, f.rows, "index_k");
  ExpectRows(buffer.data(), p.index_q.rows, f.index_q.bytes.data(), Hi * Di * 2, f.rows, "index_q");
  ExpectRows(buffer.data(), p.index_w.rows, f.index_w.bytes.data(), Hi * 2, f.rows, "index_w");
  ExpectRows(buffer.data(), p.query.rows, f.q_latent.bytes.data(), H * L * 2, f.rows, "q_latent");
  ExpectRows(buffer.data(), p.q_rope.rows, f.q_rope.bytes.data(), H * R * 2, f.rows, "q_rope");
}

TEST(LayerUpload, EachKindOfCallCarriesOnlyWhatItUses) {
  Fixture f(DType::kF32, DType::kF32);
  const ModelSpec& s = f.spec;
  const CacheLayout layout = CacheLayout::ForModel(s, DType::kF32, 16);
  std::vector<uint8_t> out(f.T * s.num_heads * s.kv_lora_rank * 4);
  {  // a shared layer: no indexer key rows, no indexer, no lse unless asked
    const LayerCall call = f.Call(1, out.data());
    const LayerUpload p = PlanLayerUpload(s, layout, f.share.size(), call, NeedsOf(call));
    EXPECT_TRUE(p.kv_latent.rows.present());
    EXPECT_FALSE(p.index_k.rows.present());
    EXPECT_FALSE(p.index_q.rows.present());
    EXPECT_FALSE(p.lse.present());
    EXPECT_TRUE(p.query.rows.present());
  }
  {  // write-only: the keys alone
    const LayerCall call = f.Call(0, nullptr);
    const LayerUpload p = PlanLayerUpload(s, layout, f.share.size(), call, NeedsOf(call));
    EXPECT_TRUE(p.index_k.rows.present());
    EXPECT_FALSE(p.index_q.rows.present());
    EXPECT_FALSE(p.query.rows.present());
    EXPECT_EQ(p.output_bytes(), 0u);
    EXPECT_EQ(p.input_bytes, p.total_bytes);
  }
  {  // context parallelism, first call: keys and the indexer, no attention
    std::vector<LayerCall::LocalCandidates> candidates(f.T);
    LayerCall call = f.Call(0, nullptr);
    call.candidates = &candidates;
    const LayerUpload p = PlanLayerUpload(s, layout, f.share.size(), call, NeedsOf(call));
    EXPECT_TRUE(p.index_q.rows.present());
    EXPECT_FALSE(p.query.rows.present());
    EXPECT_EQ(p.keys_bytes, p.input_bytes);
  }
  {  // context parallelism, second call: a given selection, no keys, no indexer
    std::vector<std::vector<int32_t>> selection(f.T);
    LayerInputs no_keys = f.in;
    no_keys.kv_latent = no_keys.k_rope = no_keys.index_k = TensorView();
    LayerCall call = f.Call(0, out.data());
    call.in = &no_keys;
    call.selection = &selection;
    const LayerUpload p = PlanLayerUpload(s, layout, f.share.size(), call, NeedsOf(call));
    EXPECT_EQ(p.keys_bytes, 0u);
    EXPECT_TRUE(p.query.rows.present());
    EXPECT_TRUE(p.out.present());
  }
}

TEST(LayerUpload, AnFp8CacheGetsTheHostQuantisersRows) {
  for (DType wire : {DType::kBF16, DType::kF32}) {
    Fixture f(wire, wire);
    const ModelSpec& s = f.spec;
    const CacheLayout layout = CacheLayout::ForModel(s, DType::kFP8E4M3, 16);
    std::vector<uint8_t> out(f.T * s.num_heads * s.kv_lora_rank * 2);
    const LayerCall call = f.Call(2, out.data());
    const LayerUpload p = PlanLayerUpload(s, layout, f.share.size(), call, NeedsOf(call));
    EXPECT_FALSE(p.kv_latent.rows.present());
    EXPECT_FALSE(p.index_k.rows.present());
    std::vector<uint8_t> buffer(p.total_bytes);
    PackLayerUpload(p, f.share, call, s, layout, buffer.data());
    const int L = s.kv_lora_rank, R = s.qk_rope_head_dim, Di = s.index_head_dim;
    const size_t lrow = layout.latent_row_bytes();
    ASSERT_EQ(p.latent_rows.bytes, f.rows.size() * lrow);
    ASSERT_EQ(p.index_rows.bytes, f.rows.size() * (Di + 4));
    std::vector<uint8_t> want(std::max<size_t>(lrow, Di + 4));
    for (size_t i = 0; i < f.rows.size(); ++i) {
      PackLatentRow(f.in.kv_latent, f.in.k_rope, f.rows[i], L, R, want.data());
      EXPECT_EQ(std::memcmp(buffer.data() + p.latent_rows.offset + i * lrow, want.data(), lrow), 0)
          << "latent row " << i;
      QuantizeKeyRow(f.in.index_k, f.rows[i], Di, Di, want.data(), want.data() + Di);
      EXPECT_EQ(
          std::memcmp(buffer.data() + p.index_rows.offset + i * (Di + 4), want.data(), Di + 4), 0)
          << "indexer row " << i;
    }
  }
}

TEST(LayerUpload, Fp8QueriesTravelAsCodesAndTheirScales) {
  Fixture f(DType::kBF16, DType::kFP8E4M3);
  const ModelSpec& s = f.spec;
  const CacheLayout layout = CacheLayout::ForModel(s, DType::kBF16, 16);
  std::vector<uint8_t> out(f.T * s.num_heads * s.kv_lora_rank * 2);
  const LayerCall call = f.Call(0, out.data());
  const LayerUpload p = PlanLayerUpload(s, layout, f.share.size(), call, NeedsOf(call));
  const int H = s.num_heads, L = s.kv_lora_rank;
  const int Hi = s.index_n_heads, Di = s.index_head_dim;
  EXPECT_EQ(p.query.heads, H);
  EXPECT_EQ(p.query.row_elems / p.query.heads, L);  // values per scale
  EXPECT_EQ(p.index_q.row_elems / p.index_q.heads, Di);
  std::vector<uint8_t> buffer(p.total_bytes);
  PackLayerUpload(p, f.share, call, s, layout, buffer.data());
  ExpectRows(buffer.data(), p.query.rows, f.q_latent.bytes.data(), H * L, f.rows, "codes");
  ExpectRows(buffer.data(), p.query.scales, f.q_latent.scales.data(), H * 4, f.rows, "scales");
  ExpectRows(buffer.data(), p.q_rope.scales, f.q_rope.scales.data(), H * 4, f.rows, "rope scales");
  ExpectRows(buffer.data(), p.index_q.scales, f.index_q.scales.data(), Hi * 4, f.rows,
             "index scales");
  // What the GPU then computes from the section equals the host's conversion of the row.
  std::vector<float> host(H * L);
  for (size_t i = 0; i < f.rows.size(); ++i) {
    for (int h = 0; h < H; ++h)
      QueryRowToF32(f.in.q_latent, f.rows[i] * H + h, L, host.data() + h * L);
    for (int e = 0; e < H * L; ++e) {
      const uint8_t code = buffer[p.query.rows.offset + i * H * L + e];
      float scale;
      std::memcpy(&scale, buffer.data() + p.query.scales.offset + (i * H + e / L) * 4, 4);
      ASSERT_EQ(fp8::E4M3ToF32(code) * scale, host[e]) << "row " << i << " value " << e;
    }
  }
}

TEST(LayerUpload, AbsorbedCallsCarryQNopeAndReturnTheValues) {
  const int dn = 8, v = 12;
  Fixture f(DType::kBF16, DType::kBF16, dn);
  const ModelSpec& s = f.spec;
  auto absorb = Absorption::Create(s, dn, v, "test").value();
  const CacheLayout layout = CacheLayout::ForModel(s, DType::kBF16, 16);
  LayerInputs in = f.in;
  in.q_latent = TensorView();
  std::vector<uint8_t> out(f.T * s.num_heads * v * 4);
  LayerCall call = f.Call(1, out.data());
  call.in = &in;
  call.absorb = absorb.get();
  call.out_dtype = DType::kF32;
  const LayerUpload p = PlanLayerUpload(s, layout, f.share.size(), call, NeedsOf(call));
  EXPECT_TRUE(p.absorbed);
  EXPECT_EQ(p.width, v);
  EXPECT_EQ(p.query.row_elems, int64_t{s.num_heads} * dn);
  EXPECT_EQ(p.out.bytes, f.rows.size() * s.num_heads * v * 4);
  std::vector<uint8_t> buffer(p.total_bytes);
  PackLayerUpload(p, f.share, call, s, layout, buffer.data());
  ExpectRows(buffer.data(), p.query.rows, f.q_nope.bytes.data(), s.num_heads * dn * 2, f.rows,
             "q_nope");
}

TEST(LayerUpload, OutputsLandOnTheShareRowsOnly) {
  Fixture f(DType::kBF16);
  const ModelSpec& s = f.spec;
  const CacheLayout layout = CacheLayout::ForModel(s, DType::kBF16, 16);
  const size_t row = size_t(s.num_heads) * s.kv_lora_rank * 2;
  std::vector<uint8_t> out(f.T * row, 0x5a);
  std::vector<float> lse(f.T * s.num_heads, -7.0f);
  const LayerCall call = f.Call(0, out.data(), lse.data());
  const LayerUpload p = PlanLayerUpload(s, layout, f.share.size(), call, NeedsOf(call));
  std::vector<uint8_t> buffer(p.total_bytes);
  for (size_t i = 0; i < buffer.size(); ++i) buffer[i] = static_cast<uint8_t>(i * 31 + 1);
  UnpackLayerOutput(p, f.share, buffer.data(), call);
  std::vector<bool> mine(f.T, false);
  for (size_t i = 0; i < f.rows.size(); ++i) {
    mine[f.rows[i]] = true;
    EXPECT_EQ(
        std::memcmp(out.data() + f.rows[i] * row, buffer.data() + p.out.offset + i * row, row), 0)
        << "output row " << f.rows[i];
    EXPECT_EQ(std::memcmp(lse.data() + f.rows[i] * s.num_heads,
                          buffer.data() + p.lse.offset + i * s.num_heads * 4, s.num_heads * 4),
              0);
  }
  for (int64_t r = 0; r < f.T; ++r) {
    if (mine[r]) continue;  // another device's rows are untouched
    EXPECT_TRUE(std::all_of(out.begin() + r * row, out.begin() + (r + 1) * row,
                            [](uint8_t b) { return b == 0x5a; }))
        << "row " << r;
    EXPECT_EQ(lse[r * s.num_heads], -7.0f);
  }
}

TEST(LayerUpload, BeginStepsBoundCoversEveryCall) {
  const int dn = 24, v = 40;  // wider than L = 32: the bound must take them
  for (DType cache : {DType::kBF16, DType::kF32, DType::kFP8E4M3})
    for (DType wire : {DType::kBF16, DType::kF32, DType::kF16})
      for (DType query : {wire, DType::kFP8E4M3})
        for (int layer = 0; layer < 2; ++layer)
          for (bool absorbed : {false, true})
            for (DType out_dtype : {DType::kBF16, DType::kF32}) {
              Fixture f(wire, query, dn);
              const ModelSpec& s = f.spec;
              auto absorb = Absorption::Create(s, dn, v, "test").value();
              const CacheLayout layout = CacheLayout::ForModel(s, cache, 16);
              LayerInputs in = f.in;
              if (absorbed) in.q_latent = TensorView();
              std::vector<uint8_t> out(1);
              std::vector<float> lse(1);
              LayerCall call = f.Call(layer, out.data(), lse.data());
              call.in = &in;
              call.out_dtype = out_dtype;
              if (absorbed) call.absorb = absorb.get();
              const LayerUpload p = PlanLayerUpload(s, layout, f.share.size(), call, NeedsOf(call));
              EXPECT_LE(p.total_bytes, MaxLayerUploadBytes(s, layout, f.share.size(), dn, v))
                  << DTypeName(cache) << " " << DTypeName(wire) << " " << DTypeName(query);
            }
}

// An import's calls (write-only: the keys alone) fit the smaller bound BeginStep reserves for a
// write-only share, which has no room for a single query.
TEST(LayerUpload, AnImportsBoundCoversItsCallsAndNoQueries) {
  for (DType cache : {DType::kBF16, DType::kF32, DType::kFP8E4M3})
    for (DType wire : {DType::kBF16, DType::kF32, DType::kF16})
      for (int layer = 0; layer < 2; ++layer) {
        Fixture f(wire, wire, 0);
        const ModelSpec& s = f.spec;
        const CacheLayout layout = CacheLayout::ForModel(s, cache, 16);
        const LayerCall call = f.Call(layer, nullptr);
        const LayerUpload p = PlanLayerUpload(s, layout, f.share.size(), call, NeedsOf(call));
        const size_t bound = MaxImportUploadBytes(s, layout, f.share.size());
        EXPECT_LE(p.total_bytes, bound) << DTypeName(cache) << " " << DTypeName(wire);
        EXPECT_LT(bound, MaxLayerUploadBytes(s, layout, f.share.size(), 0, 0) / 2);
      }
}

}  // namespace
}  // namespace attnd::cuda
