// Importing a sequence into a server by write-only steps: the one loop that a handoff
// (HandOffSequence, `attnctl handoff`) and a drain (cluster/drain.cc) run. The copy is opened as
// a handoff target (OpenSequenceRequest.import_length: ordinary steps wait until it holds every
// token) at the source's generation (its workers' fencing holds on the copy too), filled chunk by
// chunk with the rows exactly as the source caches them, and checked before it counts.
//
// The replicator's shipping (cluster/replication_shipping.cc) is not this loop: it sends the
// rows several sequences committed since their last acknowledgement, in one step, to copies
// that stay standbys.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "attnd/v1/attention.pb.h"

namespace attnd::client {

class Client;

// The rows of an import in the order they are sent: for each chunk of tokens, one ExportChunk per
// layer, layer 0 first (ExportSequence's stream, or a replica's own cache). Returns false once
// every chunk was given; an error ends the import (its partial copy is closed).
using ExportChunkSource = std::function<absl::StatusOr<bool>(v1::ExportChunk* chunk)>;

// The copy an import makes.
struct ImportTarget {
  std::string id;
  int64_t length = 0;       // committed tokens it will hold
  uint64_t generation = 0;  // the source's generation
};

// Opens `target.id` on `to`, writes every chunk `next` gives by write-only steps (a chunk's layer
// 0 begins one), and checks that `to` holds `length` tokens at `generation`. On any failure, the
// source's included, the open step there is aborted and the partial copy closed, and the error is
// returned; the source is never touched.
absl::Status ImportSequence(Client& to, const ImportTarget& target, const ExportChunkSource& next);

}  // namespace attnd::client
