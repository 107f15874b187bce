// Admission: the checks BeginStep makes on a batch before it reserves anything (docs/trust.md).
// Pure functions of the model, the limits and a sequence's state; Engine::Impl::TryBegin
// (admission.cc) applies them under the engine lock, then reserves pages and binds sequences.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "absl/status/status.h"
#include "common/model_spec.h"
#include "engine/engine.h"

namespace attnd {

// Sum over positions p in [len, len + q) of min(p + 1, k): the most keys q new queries of a
// sequence of `len` tokens attend on a token-mode sparse layer.
int64_t CappedKeys(int64_t len, int64_t q, int64_t k);

// The step's options: attend_only only with context_parallel, context_parallel not with
// write_only (INVALID_ARGUMENT). Whether the devices serve context parallelism is the engine's.
absl::Status CheckStepOptions(const StepOptions& options);

// A context-parallel entry's slice (entry `i`, its sequence `id` of `length` local tokens):
// a page-aligned position_offset in [0, max_context]; on attend-only steps a query_position
// after the slice's keys, else none and the new tokens within max_context.
absl::Status CheckSlice(const ModelSpec& spec, size_t i, const std::string& id, int64_t length,
                        const StepEntry& e, bool attend_only);

// Entry `i` of a batch whose earlier entries hold `tokens_before` new tokens, for its sequence
// `id` of `length` tokens: q_len >= 1, the slice (context-parallel steps), max_context, and the
// step's token budget. The first failing rule's status.
absl::Status CheckEntry(const ModelSpec& spec, const EngineLimits& limits,
                        const StepOptions& options, size_t i, const StepEntry& e,
                        const std::string& id, int64_t length, int64_t tokens_before);

// Bounds on what an entry's q_len queries attend, for traces before they are made: every key
// each sees (its position + 1; on attend-only steps the slice's `length`), and the same capped
// at K (what a token-mode sparse layer attends).
struct AttendedKeys {
  int64_t visible = 0;
  int64_t topk = 0;
};
AttendedKeys EntryKeys(const ModelSpec& spec, bool attend_only, int64_t length, int64_t q_len);

}  // namespace attnd
