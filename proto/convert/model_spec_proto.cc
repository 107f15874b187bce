#include "proto/convert/model_spec_proto.h"

#include <string>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace attnd {

void ModelSpecToProto(const ModelSpec& s, v1::ModelSpec* m) {
  m->set_name(s.name);
  for (LayerKind k : s.layers) m->add_layers(std::string(LayerKindName(k)));
  m->set_kv_lora_rank(s.kv_lora_rank);
  m->set_qk_rope_head_dim(s.qk_rope_head_dim);
  m->set_num_heads(s.num_heads);
  m->set_index_n_heads(s.index_n_heads);
  m->set_index_head_dim(s.index_head_dim);
  m->set_index_topk(s.index_topk);
  m->set_page_size(s.page_size);
  m->set_sm_scale(s.sm_scale);
  m->set_max_context(s.max_context);
  m->set_selection(SelectionModeName(s));
  m->set_page_union_max_pages(s.page_union_max_pages);
  m->set_prefill(std::string(PrefillModeName(s.prefill)));
  m->set_sliding_window(s.sliding_window);
  m->set_soft_cap(s.soft_cap);
}

absl::StatusOr<ModelSpec> ModelSpecFromProto(const v1::ModelSpec& m) {
  ModelSpec s;
  s.name = m.name();
  for (const std::string& k : m.layers()) {
    ASSIGN_OR_RETURN(LayerKind kind, ParseLayerKind(k));
    s.layers.push_back(kind);
  }
  s.kv_lora_rank = m.kv_lora_rank();
  s.qk_rope_head_dim = m.qk_rope_head_dim();
  s.num_heads = m.num_heads();
  s.index_n_heads = m.index_n_heads();
  s.index_head_dim = m.index_head_dim();
  s.index_topk = m.index_topk();
  s.page_size = m.page_size();
  s.sm_scale = m.sm_scale();
  s.max_context = m.max_context();
  s.page_union_max_pages = m.page_union_max_pages();
  RETURN_IF_ERROR(ParseSelectionMode(m.selection(), &s));
  ASSIGN_OR_RETURN(s.prefill, ParsePrefillMode(m.prefill()));
  s.sliding_window = m.sliding_window();
  s.soft_cap = m.soft_cap();
  RETURN_IF_ERROR(ValidateModelSpec(s));
  return s;
}

}  // namespace attnd
