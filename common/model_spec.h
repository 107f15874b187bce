// The model spec: everything attnd must know about a model's attention layers.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "common/dtype.h"

namespace attnd {

// What a layer does. Full layers own an indexer; shared layers reuse the selection of the nearest
// preceding full layer of the same step (IndexShare); dense layers attend every visible key.
enum class LayerKind : uint8_t { kFull, kShared, kDense };

// How a full layer turns indexer scores into the keys attended (docs/numerics.md).
enum class SelectionMode : uint8_t {
  kToken,       // exactly the top-k tokens
  kPageUnion,   // pages holding any top-k token, best `page_union_max_pages` by best token, + own
                // page
  kPageBudget,  // best `page_budget` pages by max token score, + own page
};

// How queries of sequences with q_len > 1 select keys.
enum class PrefillMode : uint8_t {
  kSparse,  // like decode: each query its own causal top-k (the trained semantics)
  kDense,   // every visible key, whatever K is (indexer keys are still written)
};

struct ModelSpec {
  std::string name;
  std::vector<LayerKind> layers;  // [num_layers]
  int kv_lora_rank = 512;         // L
  int qk_rope_head_dim = 64;      // R
  int num_heads = 128;            // H, all shards together
  int index_n_heads = 64;         // Hi
  int index_head_dim = 128;       // Di
  int index_topk = 2048;          // K
  int page_size = 64;             // tokens per cache page
  double sm_scale = 0;            // softmax scale, from the model (never derived from L+R)
  int64_t max_context = 131072;   // longest sequence, in tokens
  SelectionMode selection = SelectionMode::kToken;
  int page_union_max_pages = 512;  // kPageUnion: pages kept, ranked by their best token
  int page_budget = 0;             // kPageBudget: B
  PrefillMode prefill = PrefillMode::kSparse;
  int sliding_window = 0;  // dense layers: keys in (pos - window, pos]; 0 = unlimited
  double soft_cap = 0;     // dense layers: s = cap * tanh(s / cap); 0 = off

  int num_layers() const { return static_cast<int>(layers.size()); }
  int latent_dim() const { return kv_lora_rank + qk_rope_head_dim; }  // L + R
  int num_full_layers() const;
  // Indexer-cache slot of full layer `layer` (0.. in layer order); -1 for other kinds.
  int FullSlot(int layer) const;
};

// Checks dims, K, page size, layer order (a shared layer needs a full layer before it).
absl::Status ValidateModelSpec(const ModelSpec& spec);

// Built-in presets: "deepseek-v3.2", "glm-5", "glm-5.2", "tiny", "demo". NOT_FOUND otherwise.
absl::StatusOr<ModelSpec> PresetModelSpec(absl::string_view name);
std::vector<std::string> PresetModelNames();

// Parses and validates the JSON form. Keys: name, layers (a string of F/S/D or a list of
// "full"/"shared"/"dense"), kv_lora_rank, qk_rope_head_dim, num_heads, index_n_heads,
// index_head_dim, index_topk, page_size, sm_scale, max_context, selection ("token",
// "page_union", "page_budget:B"), page_union_max_pages, prefill ("sparse"/"dense"),
// sliding_window, soft_cap; "base": a preset the others override.
absl::StatusOr<ModelSpec> ParseModelSpecJson(absl::string_view json);

// The first key a query at `pos` sees when it attends a contiguous range on a layer of `kind`:
// pos + 1 - sliding_window on dense layers with a window, else 0.
int64_t FirstVisibleKey(const ModelSpec& spec, LayerKind kind, int64_t pos);

// Whether a sparse (full or shared layer) query that sees `visible` keys selects every one of
// them, so the indexer can be skipped: in token mode when visible <= K; in page_union mode when
// also every visible page fits under page_union_max_pages; in page_budget mode when the visible
// pages fit the budget. One rule for every backend.
bool SelectsEveryVisibleKey(const ModelSpec& spec, int64_t visible);

// Context parallelism: how many candidates a query keeps for a full layer's global selection:
// K tokens, or under page_budget the budget's pages.
int64_t CandidatesPerQuery(const ModelSpec& spec);

absl::string_view LayerKindName(LayerKind k);
std::string SelectionModeName(const ModelSpec& spec);  // "token", "page_union", "page_budget:8"
absl::string_view PrefillModeName(PrefillMode m);

// The inverses of the names above, shared by the JSON form and the wire form
// (proto/model_spec_proto): INVALID_ARGUMENT naming what is accepted otherwise.
absl::StatusOr<LayerKind> ParseLayerKind(absl::string_view name);  // "full", "shared", "dense"
// "token", "page_union" or "page_budget:B"; sets spec->selection (and page_budget).
absl::Status ParseSelectionMode(absl::string_view name, ModelSpec* spec);
absl::StatusOr<PrefillMode> ParsePrefillMode(absl::string_view name);  // "sparse", "dense"

}  // namespace attnd
