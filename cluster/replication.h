// Standby replicas (docs/replication.md): every sequence this replica holds as primary has a
// standby copy on the peer its rendezvous hash ranks next (client::Ranked over the replicas'
// names, this one left out), and every committed step's new key rows follow it there, exactly
// as cached (ExportSequence's chunks, imported by write-only steps that name the sequence's
// generation). Forks, imports and promotions start a copy; closes end it.
//
// A thread per peer ships what its sequences committed since its last acknowledgement, one Step
// call per round (a write-only step for several sequences of one tenant, bounded by the ack
// timeout), reading the rows out of the cache when it sends them (memory is bounded by the batch
// it sends, never by the lag). `async`: a commit's reply goes at once unless the sequence would
// lag by more than max_lag_steps commits, then it waits. `sync`: the reply waits until the
// standby has every row the step committed. A standby that acknowledges nothing within
// ack_timeout degrades: replies go without waiting for it (the log and metrics say so) until it
// acknowledges again. A sequence whose copy is made from scratch is unprotected until it caught
// up (its commits do not wait for the whole copy).
//
// Fencing: a standby promoted elsewhere refuses this replica's rows (their generation is old),
// or says so when asked before a step on a sequence it has not acknowledged for ack_timeout
// (Confirm); the copy here is then dropped, and its calls are refused as failed over (FencedAt).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/container/flat_hash_map.h"
#include "absl/status/statusor.h"
#include "client/attnd_client.h"
#include "cluster/replication_hook.h"
#include "cluster/standby_ranking.h"
#include "engine/engine.h"

namespace attnd {

class Replicator final : public ReplicationHook {
 public:
  static absl::StatusOr<std::unique_ptr<Replicator>> Create(Engine* engine,
                                                            ReplicationOptions options);
  ~Replicator();  // stops the threads (copies in flight stay where they are)
  Replicator(const Replicator&) = delete;
  Replicator& operator=(const Replicator&) = delete;

  const ReplicationOptions& options() const override { return options_; }
  // A primary was opened, forked, imported or promoted here, holding `length` tokens: it gets a
  // standby copy (never on the replica named `avoid`, the one a promotion failed over from).
  // Until the copy has caught up with what the sequence held (at once for an empty one), the
  // sequence is unprotected and its commits answer without waiting. Known ones: nothing.
  void Track(const SequenceKey& key, uint64_t generation, int64_t length,
             const std::string& avoid = "") override;
  // It was closed here: its standby copy is closed too.
  void Closed(const SequenceKey& key) override;
  // It left this replica another way (a drain promoted its standby): forget it, keep the copy.
  void Forget(const SequenceKey& key);
  // Where each key's committed rows stand when a reply goes (LayerOutput.protection):
  // "replicated", "shipping" (async, within the lag bound), "unprotected"; "" for a key not
  // replicated from here (closed meanwhile).
  // A step committed `keys` (at `lengths`, when the caller knows them: the engine's layer result
  // names them, so no engine lock is taken here; looked up otherwise): `then` runs (on some
  // thread, possibly this one) when its reply may go: OK with each key's protection, or
  // FAILED_PRECONDITION when a key was fenced meanwhile.
  void Committed(const std::vector<SequenceKey>& keys,
                 std::function<void(absl::Status, Protections)> then,
                 const std::vector<int64_t>* lengths = nullptr) override;
  // Before a step: each key whose standby has acknowledged nothing for longer than ack_timeout
  // (a replica that was paused or cut off) is looked up on its standby; one promoted there is
  // fenced here (FAILED_PRECONDITION). A standby that does not answer confirms nothing and
  // refuses nothing (the step goes on, as commits do when it is down); it is marked down, so
  // the step's commit answers unprotected, and is not asked again for the step's other keys.
  // With leases (options().lease): a key whose lease has less than a quarter of it left is
  // renewed by asking its standby (DescribeSequence with lease_ms); one whose lease ran out
  // (the standby did not answer) is refused UNAVAILABLE; *commit_by: the earliest lease's end.
  absl::Status Confirm(const std::vector<SequenceKey>& keys,
                       std::chrono::steady_clock::time_point* commit_by = nullptr) override;
  // The replica holding key's standby copy ("" when none).
  std::string StandbyOf(const SequenceKey& key) const override;
  // Nonzero: this replica's copy was dropped because the sequence failed over to another replica
  // (at this generation or later).
  uint64_t FencedAt(const SequenceKey& key) const override;
  // Waits until key's standby holds every committed row (a drain, before it promotes it there);
  // DEADLINE_EXCEEDED, NOT_FOUND (untracked), UNAVAILABLE (no standby).
  absl::Status Flush(const SequenceKey& key, std::chrono::steady_clock::time_point deadline);
  ReplicationStats Stats() const override;

 private:
  using Clock = std::chrono::steady_clock;
  // A commit's reply, waiting for `left` sequences' acknowledgements.
  struct Pending {
    int left = 1;  // one more while Committed is still adding waiters
    absl::Status status;
    Protections protection;  // by key, in the step's order
    std::function<void(absl::Status, Protections)> then;
  };
  struct Waiter {
    int64_t target = 0;  // acknowledged rows that release it
    std::shared_ptr<Pending> pending;
    Clock::time_point since;
    size_t index = 0;  // the key's place in pending->protection
  };
  // A primary here and its standby copy.
  struct Seq {
    uint64_t generation = 1;
    int peer = -1;        // peers_ index; -1: none chosen (none up)
    std::string avoid;    // never this replica (a promotion failed over from it)
    bool opened = false;  // the copy exists on the peer
    bool queued = false;  // in its peer's queue
    bool busy = false;    // its peer's thread is sending it now
    bool closed = false;  // closed here while busy: its copy is closed after the send
    // The copy held every row the sequence had when a round began: commits wait on it from then
    // on (before, while a whole copy is made, they would wait for all of it).
    bool forgotten = false;  // Forget while busy: its copy stays (it is a primary there now)
    // Opened again (Track) while closed and busy: once the round ends, a fresh copy starts.
    bool reopened = false;
    int64_t reopened_length = 0;
    bool reopened_committed = false;  // the new sequence committed before its copy began
    std::string reopened_avoid;
    bool caught_up = false;
    Clock::time_point heard = Clock::now();  // its standby's last acknowledgement
    // Leases: until when this replica may commit the sequence (3/4 of the lease after the
    // start of the last call its standby answered); none until the copy is opened.
    Clock::time_point leased_until{};
    int64_t shipped = 0;          // rows the copy holds (acknowledged)
    std::deque<int64_t> commits;  // lengths of commits not acknowledged yet, oldest first
    std::vector<Waiter> waiters;
  };
  struct Peer {
    std::string address;
    std::string name;   // "" until it answered ServerInfo
    bool self = false;  // this replica (left out)
    bool up = false;
    bool failed = false;  // its last call failed (chosen for no new copy until it answers)
    // It left commits unacknowledged for ack_timeout: commits answer without waiting for it
    // (and are not counted against it) until it acknowledges again.
    bool degraded = false;
    Clock::time_point down_since;
    Clock::time_point heard;        // its last answer
    std::deque<SequenceKey> queue;  // sequences with rows or an open to send
    // Copies to close there, each at its generation (a copy promoted there since is left alone).
    std::vector<std::pair<SequenceKey, uint64_t>> closes;
    std::condition_variable cv;
    std::thread thread;
    // The peer's thread alone: a connection per tenant (copies are opened as their tenant).
    absl::flat_hash_map<std::string, std::unique_ptr<client::Client>> clients;
    // The peer's thread alone: tokens one write-only step may carry there (0: chunk_tokens),
    // halved while its cache refuses a step that large, doubled back after each one it takes.
    int64_t batch_tokens = 0;
    // Confirm's (any thread, under mu_; a Client's calls are thread safe).
    absl::flat_hash_map<std::string, std::shared_ptr<client::Client>> confirm_clients;
  };
  Replicator(Engine* engine, ReplicationOptions options);
  void PeerLoop(Peer* peer);
  void Housekeeping();
  // Under mu_: the peer for a sequence (-1: none up).
  int ChoosePeer(const SequenceKey& key, const std::string& avoid) const;
  // Under mu_: the peer did not answer (a send, or Confirm's question): down since now, and
  // chosen for no new copy until it answers.
  void MarkDown(Peer& p);
  // Under mu_: a call that began at `sent` reached s's standby: its lease runs from then.
  void Renew(Seq& s, Clock::time_point sent) const;
  // Under mu_: marks key dirty on its peer.
  void Wake(const SequenceKey& key, Seq& s);
  // Under mu_: releases the waiters the acknowledgements satisfy (and, with `all`, every one,
  // with `why`), adding their replies to *run (called once mu_ is released).
  void Settle(Seq& s, std::vector<std::function<void()>>* run, bool all = false,
              const absl::Status& why = absl::OkStatus());
  // Under mu_: one fewer wait for p; the last one counts its protections and adds its reply.
  void Release(const std::shared_ptr<Pending>& p, std::vector<std::function<void()>>* run);
  // Drops this replica's copy: the standby was promoted elsewhere (at `generation`).
  void Fence(const SequenceKey& key, uint64_t generation);
  // One round of a peer's work: kIdle when there was none (the peer was not called), else
  // whether the peer answered (kFailed: back off).
  // kRetry: this replica could not read a sequence's rows (a tier full, a move that does not
  // end): the peer is fine; the round is tried again shortly.
  enum class Round { kIdle, kOk, kFailed, kRetry };
  Round Ship(Peer* peer);
  // Resolves the peer list (dns: names) and starts a thread for each new address.
  void AddPeers();
  // Resolves a peer's name; false when it does not answer.
  bool Resolve(Peer* peer);
  absl::StatusOr<client::Client*> ClientFor(Peer* peer, const std::string& tenant);

  Engine* engine_;
  ReplicationOptions options_;
  int64_t bytes_per_token_ = 0;  // every layer's cached row
  mutable std::mutex mu_;
  std::condition_variable cv_;  // housekeeping's wake-up
  bool stop_ = false;
  std::vector<std::unique_ptr<Peer>> peers_;
  absl::flat_hash_map<SequenceKey, Seq> seqs_;
  absl::flat_hash_map<SequenceKey, uint64_t> fenced_;
  std::deque<SequenceKey> fenced_order_;  // oldest first, bounded
  std::vector<SequenceKey> to_close_;     // fenced copies still to close here (were busy)
  ReplicationStats totals_;
  std::thread housekeeping_;
};

}  // namespace attnd
