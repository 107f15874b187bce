// Client-side routing of sequences to attnd replicas by rendezvous (highest random weight)
// hashing (docs/architecture.md, "Routing"): every sequence goes to the replica whose name has
// the highest hash with the sequence id, so all of its steps meet its KV cache, and when a
// replica joins or leaves only the sequences that hash to it move. The hash is over replica
// *names* (ServerInfo.replica_name, --replica-name: a StatefulSet pod's name), not addresses, so
// a replica back under a new address owns what it owned. The hash is fixed (FNV-1a 64 + a
// splitmix64 finaliser) so C++ and Python clients and the drain agree (`attnd.route`).
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "client/attnd_client.h"
#include "common/block_hash.h"

namespace attnd::client {

// The rendezvous weight of `sequence_id` on the replica named `name`.
uint64_t RendezvousWeight(const std::string& name, const std::string& sequence_id);

// The name `sequence_id` belongs to (ties to the lexicographically smaller name); empty when
// there are none.
std::string Route(const std::vector<std::string>& names, const std::string& sequence_id);

// `names` in the order `sequence_id` ranks them: its owner (Route) first, then the replica that
// would own it without the owner, and so on. A drain hands a sequence to the first of these
// that remains; a client that misses on the owner looks there next.
std::vector<std::string> Ranked(std::vector<std::string> names, const std::string& sequence_id);

// Every address `host` resolves to, as "ip:port" (a Kubernetes headless Service name gives one
// per ready pod). UNAVAILABLE when it resolves to nothing.
absl::StatusOr<std::vector<std::string>> ResolveEndpoints(const std::string& host, int port);

// Whether `address` ("host:port", "dns:host:port" or "unix:PATH") refuses a connection now:
// nothing listens there (the process is gone). False when it accepts, or does not answer within
// `timeout` (a paused or cut-off replica). Router::FailOver releases a gone primary's lease.
bool RefusesConnections(const std::string& address, std::chrono::milliseconds timeout);
// PromoteSequence's refusal while a primary's lease runs: the ms left (-1: another status).
int64_t LeaseLeftMs(const absl::Status& status);

// Prefix-aware routing (docs/prefix_cache.md#routing): what a replica holds of a new sequence's
// prompt, its room and its work.
struct PrefixCandidate {
  std::string name;
  int64_t cached_blocks = 0;  // leading blocks of the prompt in its prefix cache
  int64_t free_pages = 0;     // device pages free (cache-only ones not counted); -1: unreachable
  int64_t total_pages = 0;
  int64_t busy = 0;  // open steps + calls queued for an executor thread (ServerInfo.load)
};
// How ChoosePrefixReplica weighs a replica: llm-d's weighted scorers, defaults from the bench
// (bench/results/prefix.md); the Python client's attnd.PrefixWeights has the same.
struct PrefixWeights {
  double cache = 1.0;  // × the fraction of the prompt's blocks it holds
  double free = 2.0;   // × the fraction of its device pages free
  double load = 0.5;   // × its busy / (the busiest replica's + 1)
};
// The replica for a new sequence of `prompt_blocks` blocks: the best score (PrefixWeights), equal
// scores to the higher rendezvous weight of `sequence_id` (then the smaller name); an unreachable
// replica only when every one is. Empty without candidates. The arithmetic is
// attnd.score_replicas', in the same order, so both clients choose alike.
std::string ChoosePrefixReplica(const std::vector<PrefixCandidate>& candidates,
                                const std::string& sequence_id, int64_t prompt_blocks = 0,
                                const PrefixWeights& weights = {});

// What a router knows of the replicas' prefix caches without asking them: client/kv_events.h's
// KvBlockIndex follows their KV events.
class PrefixView {
 public:
  virtual ~PrefixView() = default;
  // The leading blocks of `hashes` replica `name` holds for `tenant`; nullopt when this view
  // cannot say (no events from it yet, or a gap in them): the router asks the replica.
  virtual std::optional<int64_t> CachedBlocks(const std::string& name, const std::string& tenant,
                                              const std::vector<BlockHash>& hashes) const = 0;
};

// A replica: the name sequences hash over, and where it is now.
struct Replica {
  std::string name;
  std::string address;
  bool operator==(const Replica& o) const { return name == o.name && address == o.address; }
};

// Each address with the name it serves under (ServerInfo.replica_name; an attnd without one is
// named by its address). Unreachable addresses are left out, with a line each in *errors.
std::vector<Replica> NameReplicas(const std::vector<std::string>& addresses,
                                  const ConnectOptions& options,
                                  std::vector<std::string>* errors = nullptr);

// A Client per replica, and the routing between them. Thread safe; a Client* it returns stays
// valid for the Router's lifetime, across membership changes.
class Router {
 public:
  // Replicas named by their addresses (routing then changes when an address does).
  explicit Router(std::vector<std::string> endpoints);
  Router(std::vector<Replica> replicas, ConnectOptions options);

  // Replaces the membership (e.g. after re-resolving the Service and NameReplicas); a replica
  // that keeps its name and address keeps its client. Names must be unique (later ones win).
  void SetReplicas(std::vector<Replica> replicas);
  // A new membership (a replica joining or leaving) without a miss: each of `sequence_ids` (this
  // worker's open sequences) whose owner changes stays routed where it is, its replica kept
  // reachable even when it left, until Rebalance moves it. Returns those to move.
  std::vector<std::string> ChangeReplicas(std::vector<Replica> replicas,
                                          const std::vector<std::string>& sequence_ids);
  // Moves the sequences ChangeReplicas kept in place (all, or those of `sequence_ids`) to their
  // new owners exactly as cached (HandOffSequence, the length confirmed, then closed where they
  // were) and routes each there from then on. Call it between their steps: one in a step,
  // importing, or whose copy failed stays where it is, routed there, for a later call. Returns
  // how many moved.
  int64_t Rebalance(const std::vector<std::string>& sequence_ids = {});
  std::map<std::string, std::string> moving() const;      // sequence -> its new owner
  int64_t rebalanced() const;                             // sequences Rebalance moved
  void SetEndpoints(std::vector<std::string> endpoints);  // names = addresses
  std::vector<Replica> replicas() const;                  // by name
  std::vector<std::string> endpoints() const;             // their addresses, by name

  // The name of the replica that owns `sequence_id` (empty without replicas): the one
  // ChooseByPrefix chose for it, else its rendezvous owner.
  std::string Pick(const std::string& sequence_id) const;
  // Prefix-aware placement of a new sequence (docs/prefix_cache.md#routing): asks every replica
  // how many leading blocks of `request` (a LookupPrefixRequest: the prompt's token ids or block
  // hashes) it holds, and its room and work (ServerInfo), and chooses by ChoosePrefixReplica
  // (SetPrefixWeights); the sequence is then that replica's for Pick and ClientFor until Forget
  // (or a Locate after a miss: its rendezvous owner is then its home, as for any other).
  // *cached_blocks: what the chosen replica said it holds. This router polls; the Python
  // client's PrefixRouter can follow the replicas' KV events instead.
  absl::StatusOr<std::string> ChooseByPrefix(const std::string& sequence_id,
                                             const v1::LookupPrefixRequest& request,
                                             int64_t* cached_blocks = nullptr);
  void Forget(const std::string& sequence_id);
  // Follow `view` (the replicas' KV events, client/kv_events.h) for ChooseByPrefix instead of
  // asking each replica, for this client's `tenant`; a replica the view cannot speak for is
  // asked. nullptr: ask every replica.
  void SetPrefixView(std::shared_ptr<const PrefixView> view, std::string tenant = "");
  void SetPrefixWeights(const PrefixWeights& weights);
  int64_t prefix_lookups() const;  // LookupPrefix calls ChooseByPrefix made
  // The client of the replica that owns `sequence_id`; nullptr without replicas.
  Client* ClientFor(const std::string& sequence_id);

  // Where to step `sequence_id`, after a call on ClientFor's client failed with NOT_FOUND or
  // UNAVAILABLE ("pull on miss"). Asks the owner, then the next-ranked replicas; where one of
  // those holds it (a drain put it there, or its owner is new), moves it to the owner exactly as
  // cached (HandOffSequence, the length confirmed, then closed there) and returns the owner's
  // client. When the owner is unreachable, or the sequence is in a step or still importing where
  // it is, returns the client of the replica holding it. NOT_FOUND when no replica holds it (it
  // may be moving: retry shortly).
  absl::StatusOr<Client*> Locate(const std::string& sequence_id);
  int64_t pulls() const;  // sequences Locate has moved to their owner

  // Failover (docs/replication.md): `sequence_id`'s primary (`failed`, default: where this
  // router routes it now) does not answer. Promotes its standby copy at `generation` (the one
  // the primary last reported) with the `length` the worker knows — on the replica holding the
  // longest copy at that generation, ties broken by `standby` first when given
  // (SequenceInfo.standby_replica), then by the order its rendezvous hash ranks the replicas
  // without `failed` — and routes the sequence there from now on (until Forget).
  // Returns the new primary's client and the promoted sequence: its generation for the next
  // steps, its length where to resume (shorter than `length` after an async standby's lag:
  // resend the steps after it). NOT_FOUND when no replica holds a copy.
  struct FailedOver {
    Client* client = nullptr;
    std::string name;
    v1::SequenceInfo info;
  };
  absl::StatusOr<FailedOver> FailOver(const std::string& sequence_id, uint64_t generation,
                                      int64_t length, std::string failed = "",
                                      const std::string& standby = "");

 private:
  Client* ClientLocked(const std::string& name);  // mu_ held
  std::string PickLocked(const std::string& sequence_id) const;
  void SetReplicasLocked(std::vector<Replica> replicas);
  // Copies sequence_id from `from` to `to` exactly, checks `to` holds `length` tokens (else
  // closes the copy there), then closes it on `from`.
  absl::Status Move(Client& from, Client& to, const std::string& sequence_id, int64_t length);

  const ConnectOptions options_;
  mutable std::mutex mu_;
  std::map<std::string, std::string> address_of_;  // name -> address
  std::vector<std::string> names_;                 // address_of_'s keys, for Route
  // ChooseByPrefix, FailOver, ChangeReplicas: sequence -> replica name
  std::map<std::string, std::string> chosen_;
  std::map<std::string, std::string> moving_;   // ChangeReplicas: sequence -> its new owner
  std::map<std::string, std::string> leaving_;  // replicas gone, still holding: name -> address
  int64_t rebalanced_ = 0;
  std::shared_ptr<const PrefixView> view_;
  PrefixWeights weights_;
  std::string view_tenant_;
  int64_t prefix_lookups_ = 0;
  std::map<std::string, Client*> clients_;  // name -> its client (owned by all_clients_)
  std::vector<std::unique_ptr<Client>> all_clients_;
  std::mutex move_mu_;  // one pull at a time (two threads missing on one sequence)
  int64_t pulls_ = 0;
};

}  // namespace attnd::client
