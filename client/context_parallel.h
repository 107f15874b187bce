// Context parallelism from the client (docs/numerics.md): one logical sequence spread over several
// attnd servers, each holding a contiguous, page-aligned slice of its positions. The client
// drives each server's step and merges what comes back: a full layer's candidates into the
// global selection (one extra round trip per full layer), every layer's partial outputs by
// log-sum-exp. The result equals one server holding the whole sequence.
//
//   ContextParallelSequence seq({a.get(), b.get()}, {0, 32768}, "req-1");  // a: [0, 32K), b: rest
//   RETURN_IF_ERROR(seq.Open());
//   ASSIGN_OR_RETURN(auto layers_out, seq.Step(T, layer_inputs));  // new tokens at the end
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/attnd_client.h"

namespace attnd::client {

class ContextParallelSequence {
 public:
  // `servers` in position order; server i holds positions [starts[i], starts[i + 1]) (the last
  // one every position from its start on). starts[0] is 0; each start a multiple of the model's
  // page size, ascending. The servers serve the same model.
  ContextParallelSequence(std::vector<Client*> servers, std::vector<int64_t> starts,
                          std::string id);

  // Checks that every server serves context parallelism (ServerInfo.context_parallel) and the
  // same model, with the starts on its pages, then opens the (empty) sequence `id` on every
  // server; on failure closes what it opened.
  absl::Status Open();
  // Closes it on every server (the first error, after trying all).
  absl::Status Close();

  struct LayerResult {
    std::vector<float> out;  // [T, H, W] merged, fp32 (W = L, or V for absorbed calls)
    std::vector<float> lse;  // [T, H]
    std::vector<std::vector<int32_t>> attended;  // [T] with `attended`: absolute positions
  };
  // One step of `q_len` new tokens at the sequence's end: layers[l] holds layer l's tensors for
  // the whole step as for one server (queries, keys, indexer tensors); they must lie in one
  // server's slice (split a chunk at a slice boundary into two steps). Every server up to that
  // one takes part. On any error every server's step is aborted: the sequence stays as it was.
  absl::StatusOr<std::vector<LayerResult>> Step(int64_t q_len,
                                                const std::vector<v1::LayerInputs>& layers,
                                                bool attended = false);

  int64_t length() const { return length_; }
  // The last step's seconds in full layers' candidates round trips (the exchange's cost).
  double candidates_seconds() const { return candidates_seconds_; }

 private:
  std::vector<Client*> servers_;
  std::vector<int64_t> starts_;
  std::string id_;
  int64_t length_ = 0;
  double candidates_seconds_ = 0;
};

}  // namespace attnd::client
