// One layer of one token chunk of a sequence's committed keys, exactly as cached: what
// ExportSequence streams and what a drain hands to a peer (the receiver imports it with a
// write-only step).
#pragma once

#include <cstdint>

#include "absl/status/status.h"
#include "attnd/v1/attention.pb.h"
#include "engine/engine.h"

namespace attnd {

// Fills *msg with rows [begin, begin + n) of `layer` of `seq` (committed length `length`).
absl::Status ReadExportChunk(const Engine& engine, const SequenceKey& seq, int layer, int64_t begin,
                             int64_t n, int64_t length, v1::ExportChunk* msg);

}  // namespace attnd
