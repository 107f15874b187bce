// What the service hands to replication and asks of it: the sequences it opens, promotes and
// closes, each step's commit, the check before a step, and what ServerInfo and the metrics show.
// The service speaks RPC and calls this; what a commit means for standby copies is the
// replicator's (cluster/replication.h, the one implementation; none: no standbys).
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "client/attnd_client.h"
#include "kv_store/tenant_ledger.h"

namespace attnd {

struct ReplicationOptions {
  enum class Mode { kAsync, kSync };
  Mode mode = Mode::kAsync;
  // --standby-peers: "host:port" each, or "dns:NAME:PORT" (DrainPeers' forms); this replica may
  // be among them (left out by its name).
  std::vector<std::string> peers;
  std::string self_name;
  // How to reach them (TLS, the admin's token: copies are opened as their tenant).
  client::ConnectOptions credentials;
  int64_t max_lag_steps = 4;
  std::chrono::milliseconds ack_timeout{1000};
  // Leases (docs/replication.md#leases): a sequence whose standby holds a copy is served only
  // while the standby answered within 3/4 of this (it grants the whole of it, from when the
  // answer's call arrived). 0: no leases.
  std::chrono::milliseconds lease{0};
  // Rows per write-only step sent to a standby (a step's entries together), at most what fits
  // in a message (AttentionService::max_export_chunk_tokens).
  int64_t chunk_tokens = 4096;
  int64_t max_batch_entries = 64;
};

// What the metrics and ServerInfo show.
struct ReplicationStats {
  int64_t sequences = 0;    // primaries here with a standby copy on a peer
  int64_t unprotected = 0;  // primaries here without one now (no peer up, or not yet copied)
  int64_t lag_steps = 0;    // the most commits a sequence's standby has not acknowledged
  int64_t lag_bytes = 0;    // cache bytes committed here and not acknowledged, all sequences
  int64_t bytes_shipped = 0;
  int64_t rows_shipped = 0;
  int64_t steps_shipped = 0;  // write-only steps the standbys committed
  int64_t fenced = 0;         // copies dropped here because a standby was promoted elsewhere
  int64_t errors = 0;         // failed calls to peers
  int64_t degraded = 0;       // commits answered without the wait they were due
  // Committing replies' entries by protection (LayerOutput.protection).
  int64_t replicated = 0, shipping = 0, unprotected_commits = 0;
  std::vector<std::string> peers;  // the peers' names, as resolved so far
};

class ReplicationHook {
 public:
  // Where each key's committed rows stand when a reply goes (LayerOutput.protection):
  // "replicated", "shipping" (async, within the lag bound), "unprotected"; "" for a key not
  // replicated from here (closed meanwhile).
  using Protections = std::vector<std::string>;
  virtual ~ReplicationHook() = default;

  virtual const ReplicationOptions& options() const = 0;
  // A primary was opened, forked, imported or promoted here, holding `length` tokens (never
  // copied to the replica named `avoid`, the one a promotion failed over from).
  virtual void Track(const SequenceKey& key, uint64_t generation, int64_t length,
                     const std::string& avoid = "") = 0;
  // It was closed here.
  virtual void Closed(const SequenceKey& key) = 0;
  // A step committed `keys` (at `lengths` when known): `then` runs when its reply may go.
  virtual void Committed(const std::vector<SequenceKey>& keys,
                         std::function<void(absl::Status, Protections)> then,
                         const std::vector<int64_t>* lengths = nullptr) = 0;
  // Before a step: FAILED_PRECONDITION when a key failed over to another replica, UNAVAILABLE
  // when this replica holds no lease for it; *commit_by (when given and leases hold): when the
  // first of the keys' leases runs out (the step must commit before).
  virtual absl::Status Confirm(const std::vector<SequenceKey>& keys,
                               std::chrono::steady_clock::time_point* commit_by = nullptr) = 0;
  // The replica holding key's standby copy ("" when none).
  virtual std::string StandbyOf(const SequenceKey& key) const = 0;
  // Nonzero: the sequence failed over to another replica at this generation or later.
  virtual uint64_t FencedAt(const SequenceKey& key) const = 0;
  virtual ReplicationStats Stats() const = 0;
};

}  // namespace attnd
