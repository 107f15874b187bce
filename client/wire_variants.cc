#include "client/wire_variants.h"

#include <algorithm>
#include <cstring>

namespace attnd::client::ctl {
namespace {
std::vector<float> Floats(const std::vector<double>& v) { return {v.begin(), v.end()}; }
}  // namespace

std::vector<v1::LayerInputs> VariantLayers(const std::vector<GeneratedLayer>& g,
                                           const WireVariant& v, int B, int H, int Dn,
                                           std::mt19937_64& rng) {
  std::vector<v1::LayerInputs> out;
  std::normal_distribution<float> dist(0.0f, 1.0f);
  for (const GeneratedLayer& l : g) {
    v1::LayerInputs in = l.wire;
    auto encode = [&](v1::Tensor* t, const std::vector<float>& f) {
      if (!v.fp8_queries && !t->data().empty()) return;  // GenerateStep's BF16 already
      std::vector<int64_t> shape(t->shape().begin(), t->shape().end());
      if (v.fp8_queries) {
        *t = MakeFp8Tensor(shape, f.data());
      } else {
        std::vector<uint16_t> b(f.size());
        ConvertFromF32(DType::kBF16, f.data(), b.data(), f.size());
        *t = MakeTensor(DType::kBF16, shape, b.data(), 2 * b.size());
      }
    };
    if (v.absorbed) {
      in.clear_q_latent();
      std::vector<float> qn(static_cast<size_t>(B) * H * Dn);
      for (float& x : qn) x = dist(rng);
      in.mutable_q_nope()->add_shape(B);
      in.mutable_q_nope()->add_shape(H);
      in.mutable_q_nope()->add_shape(Dn);
      encode(in.mutable_q_nope(), qn);
    } else {
      encode(in.mutable_q_latent(), Floats(l.values.q_latent));
    }
    encode(in.mutable_q_rope(), Floats(l.values.q_rope));
    if (in.has_index_q()) encode(in.mutable_index_q(), Floats(l.values.index_q));
    if (v.fp8_reply) in.set_out_datatype("FP8_E4M3");
    out.push_back(std::move(in));
  }
  return out;
}

absl::Status ImportContexts(Client& c, const ModelSpec& spec, const Batch& batch,
                            std::mt19937_64& rng) {
  constexpr int64_t kImportChunk = 2048;
  for (const auto& [id, length] : batch) {
    for (int64_t done = 0; done < length; done += kImportChunk) {
      const int64_t n = std::min(kImportChunk, length - done);
      auto g = GenerateStep(spec, n, DType::kBF16, true, rng);
      auto begun = c.BeginStep({{id, n}}, true);
      if (!begun.ok()) return begun.status();
      for (auto& l : g)
        if (auto o = c.AttendLayer(begun->step_id(), l.wire); !o.ok()) return o.status();
    }
  }
  return absl::OkStatus();
}

std::vector<v1::LayerInputs> InSharedMemory(const std::vector<v1::LayerInputs>& layers,
                                            SharedMemory& mem, const std::string& region,
                                            size_t out_bytes) {
  std::vector<v1::LayerInputs> out;
  int64_t off = 0;
  for (v1::LayerInputs in : layers) {
    for (v1::Tensor* t :
         {in.mutable_q_latent(), in.mutable_q_nope(), in.mutable_q_rope(), in.mutable_kv_latent(),
          in.mutable_k_rope(), in.mutable_index_q(), in.mutable_index_k(), in.mutable_index_w()}) {
      if (t->datatype().empty()) continue;
      const int64_t n = static_cast<int64_t>(t->data().size());
      std::memcpy(mem.data() + off, t->data().data(), static_cast<size_t>(n));
      t->clear_data();
      t->mutable_shm()->set_region(region);
      t->mutable_shm()->set_offset(off);
      t->mutable_shm()->set_byte_size(n);
      off += n;
    }
    if (out_bytes > 0) {
      in.mutable_out_shm()->set_region(region);
      in.mutable_out_shm()->set_offset(off);
      in.mutable_out_shm()->set_byte_size(static_cast<int64_t>(out_bytes));
      off += static_cast<int64_t>(out_bytes);
    }
    out.push_back(std::move(in));
  }
  return out;
}

}  // namespace attnd::client::ctl
