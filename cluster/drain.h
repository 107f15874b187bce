// Drain (docs/lifecycle.md): before a replica exits, every sequence it holds is handed to one of
// the remaining replicas — the one the clients' rendezvous hash picks over them (client::Route), so
// a worker that gets UNAVAILABLE here finds its sequence where it will look for it. The keys move
// exactly as cached (ExportSequence's chunks, imported with write-only steps); a sequence is
// closed here only after the peer confirms its length.
#pragma once

#include <chrono>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/attnd_client.h"
#include "engine/engine.h"

namespace attnd {

class Replicator;

struct DrainOptions {
  // The remaining replicas: "host:port" each, or "dns:NAME:PORT" for every address NAME resolves
  // to (a headless Service) except this host's own.
  std::vector<std::string> peers;
  // This replica's name: a peer answering with it (this host listed among the peers) is left
  // out. Sequences go by the hash over the peers' names (client::NameReplicas).
  std::string self_name;
  // How to reach them: TLS files and the admin identity's token (sequences of a tenant are
  // opened on the peer as that tenant: metadata attnd-tenant).
  client::ConnectOptions credentials;
  std::chrono::milliseconds timeout{60000};  // for open steps to end, then for the moves
  int64_t chunk_tokens = 4096;
  // Sequences moved at once, each on its own connection: one move is a chain of per-layer round
  // trips that leaves both hosts mostly idle, so several overlap.
  int parallel = 4;
  // Standby replicas (docs/replication.md), or null: a sequence whose standby copy is on the
  // peer it goes to is caught up there and promoted instead of copied; another's copy is closed
  // once it moved. Standby copies held here stay (their primaries choose new ones).
  Replicator* replicator = nullptr;
};

struct DrainReport {
  int moved = 0;
  int failed = 0;  // left here (and lost at exit)
  std::string first_error;
  std::vector<std::string> peers;  // the peers the hash ran over, "name (address)"
};

// The peers as endpoints: "dns:" entries resolved, this host's addresses dropped.
absl::StatusOr<std::vector<std::string>> DrainPeers(const std::vector<std::string>& peers);

// Waits until no step is open or the deadline passes (open steps' layers are still served; the
// service refuses new ones); returns how many are still open.
int64_t AwaitOpenSteps(const Engine& engine, std::chrono::steady_clock::time_point deadline);

// Waits (until the timeout) for open steps to end, then moves every sequence of every tenant.
// The service must already refuse new sequences and steps.
DrainReport DrainSequences(Engine& engine, const DrainOptions& options);

}  // namespace attnd
