// Engine::RunLayer as tests, benchmarks and fuzzers mostly call it: into a caller's buffer of
// `bytes` (BufferSink: a size the call does not produce is INVALID_ARGUMENT "output buffer"),
// with an optional trace and [T, H] lse written to the caller's pointers.
#pragma once

#include <cstring>

#include "engine/engine.h"

namespace attnd::testing {

// kAttend, or kSelection when `selection` is given.
inline absl::Status RunLayerInto(Engine& engine, const StepRef& step, int layer,
                                 const LayerInputs& in, void* out, size_t bytes,
                                 LayerTrace* trace = nullptr, float* lse = nullptr,
                                 const Candidates* selection = nullptr) {
  LayerRequest r;
  r.layer = layer;
  r.tensors = in;
  if (selection != nullptr) {
    r.mode = LayerMode::kSelection;
    r.selection = selection;
  }
  r.want_trace = trace != nullptr;
  r.want_lse = lse != nullptr;
  BufferSink sink(out, bytes);
  absl::StatusOr<LayerResult> result = engine.RunLayer(step, r, &sink);
  if (!result.ok()) return result.status();
  if (trace != nullptr) *trace = std::move(result->trace);
  if (lse != nullptr && !result->lse.empty())
    std::memcpy(lse, result->lse.data(), result->lse.size() * sizeof(float));
  return absl::OkStatus();
}

// A context-parallel full layer's first call (kCandidates) into *out.
inline absl::Status RunCandidatesInto(Engine& engine, const StepRef& step, int layer,
                                      const LayerInputs& in, Candidates* out) {
  LayerRequest r;
  r.layer = layer;
  r.tensors = in;
  r.mode = LayerMode::kCandidates;
  absl::StatusOr<LayerResult> result = engine.RunLayer(step, r, nullptr);
  if (!result.ok()) return result.status();
  *out = std::move(result->candidates);
  return absl::OkStatus();
}

}  // namespace attnd::testing
