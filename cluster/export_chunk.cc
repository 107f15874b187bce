#include "cluster/export_chunk.h"

#include <string>

#include "common/fp8.h"
#include "common/status_macros.h"

namespace attnd {

absl::Status ReadExportChunk(const Engine& engine, const SequenceKey& seq, int layer, int64_t begin,
                             int64_t n, int64_t length, v1::ExportChunk* msg) {
  const ModelSpec& s = engine.spec();
  ASSIGN_OR_RETURN(Engine::LayerRows rows, engine.ReadRows(seq, layer, begin, begin + n));
  const DType cache = engine.options().cache_dtype;
  const bool fp8 = cache == DType::kFP8E4M3;
  const std::string dt(DTypeName(cache));
  msg->Clear();
  msg->set_token_begin(begin);
  msg->set_tokens(n);
  msg->set_length(length);
  if (layer == 0) {  // the blocks travel with their rows (the receiver's prefix cache)
    ASSIGN_OR_RETURN(const std::vector<BlockHash> hashes,
                     engine.CompletedBlockHashes(seq, begin, begin + n));
    for (const BlockHash& h : hashes)
      msg->add_block_hashes(reinterpret_cast<const char*>(h.data()), h.size());
  }
  v1::LayerInputs* k = msg->mutable_keys();
  k->set_layer(layer);
  auto set = [&](v1::Tensor* t, const std::string& dtype, std::string* bytes, int64_t dim) {
    t->set_datatype(dtype);
    t->add_shape(n);
    t->add_shape(dim);
    t->mutable_data()->swap(*bytes);
  };
  // An fp8 cache's keys go as they are cached: e4m3 values with their fp32 scales, rope bf16.
  set(k->mutable_kv_latent(), dt, &rows.kv_latent, s.kv_lora_rank);
  if (fp8)
    set(k->mutable_kv_latent()->mutable_scales(), "FP32", &rows.kv_latent_scales,
        fp8::LatentTiles(s.kv_lora_rank));
  set(k->mutable_k_rope(), fp8 ? "BF16" : dt, &rows.k_rope, s.qk_rope_head_dim);
  if (s.layers[layer] == LayerKind::kFull) {
    set(k->mutable_index_k(), dt, &rows.index_k, s.index_head_dim);
    if (fp8) set(k->mutable_index_k()->mutable_scales(), "FP32", &rows.index_k_scales, 1);
  }
  return absl::OkStatus();
}

}  // namespace attnd
