#include "service/export_chunk.h"

#include <string>

#include "common/status_macros.h"

namespace attnd {

absl::Status ReadExportChunk(const Engine& engine, const SequenceKey& seq, int layer, int64_t begin,
                             int64_t n, int64_t length, v1::ExportChunk* msg) {
  const ModelSpec& s = engine.spec();
  ASSIGN_OR_RETURN(Engine::LayerRows rows, engine.ReadRows(seq, layer, begin, begin + n));
  const std::string dt(DTypeName(engine.options().cache_dtype));
  msg->Clear();
  msg->set_token_begin(begin);
  msg->set_tokens(n);
  msg->set_length(length);
  v1::LayerInputs* k = msg->mutable_keys();
  k->set_layer(layer);
  auto set = [&](v1::Tensor* t, std::string* bytes, int64_t dim) {
    t->set_datatype(dt);
    t->add_shape(n);
    t->add_shape(dim);
    t->mutable_data()->swap(*bytes);
  };
  set(k->mutable_kv_latent(), &rows.kv_latent, s.kv_lora_rank);
  set(k->mutable_k_rope(), &rows.k_rope, s.qk_rope_head_dim);
  if (s.layers[layer] == LayerKind::kFull)
    set(k->mutable_index_k(), &rows.index_k, s.index_head_dim);
  return absl::OkStatus();
}

}  // namespace attnd
