// Fencing (cluster/replication.h): a standby promoted elsewhere means this replica's copy is
// stale. Confirm asks a standby not heard from for ack_timeout before a step; Fence drops the
// copy here and keeps a tombstone so that its calls are refused as failed over (FencedAt).
#include <glog/logging.h>

#include <algorithm>
#include <set>

#include "absl/strings/str_cat.h"
#include "client/router.h"
#include "cluster/replication.h"
#include "common/client_text.h"

namespace attnd {
namespace {

constexpr size_t kMaxFenced = 65536;  // tombstones kept (oldest forgotten first)

}  // namespace

absl::Status Replicator::Confirm(const std::vector<SequenceKey>& keys,
                                 Clock::time_point* commit_by) {
  struct Ask {
    SequenceKey key;
    uint64_t generation;
    std::string address;
    std::shared_ptr<client::Client> client;
  };
  const bool leases = options_.lease.count() > 0;
  std::vector<Ask> asks;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto now = Clock::now();
    for (const SequenceKey& k : keys) {
      auto it = seqs_.find(k);
      if (it == seqs_.end() || it->second.peer < 0 || !it->second.opened) continue;
      const Seq& s = it->second;
      // Silent for a while: promoted elsewhere meanwhile? With leases, also a lease running low.
      if (now - s.heard < options_.ack_timeout &&
          (!leases || s.leased_until - now > options_.lease / 4))
        continue;
      // A standby down for a while is not asked (each step would wait for it); one that failed
      // just now is: its call may have failed because this replica was the one paused.
      Peer& p = *peers_[s.peer];
      if (p.degraded || (!p.up && now - p.down_since > 2 * options_.ack_timeout)) continue;
      asks.push_back({k, s.generation, p.address, p.confirm_clients[k.tenant]});
    }
  }
  std::set<std::string> silent;  // standbys that did not answer this call: not asked again
  for (Ask& a : asks) {
    if (silent.contains(a.address)) continue;
    if (a.client == nullptr) {
      client::ConnectOptions c = options_.credentials;
      c.act_as_tenant = a.key.tenant;
      c.call_timeout_ms = options_.ack_timeout.count();
      c.reconnect_backoff_ms = 50;
      auto made = client::Client::Connect(a.address, c);
      if (!made.ok()) continue;
      a.client = std::shared_ptr<client::Client>(std::move(*made));
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& p : peers_)
        if (p->address == a.address) p->confirm_clients[a.key.tenant] = a.client;
    }
    const Clock::time_point sent = Clock::now();
    auto there = a.client->DescribeSequence(a.key.id, options_.lease.count());
    if ((absl::IsUnavailable(there.status()) || absl::IsDeadlineExceeded(there.status())) &&
        leases && client::RefusesConnections(a.address, std::chrono::milliseconds(200)))
      there = absl::NotFoundError("the standby's address refuses connections");  // gone
    if (absl::IsUnavailable(there.status()) || absl::IsDeadlineExceeded(there.status())) {
      // Not answering: down, as a failed send would find it (its commits answer unprotected
      // until it answers again; the peer's thread asks it).
      silent.insert(a.address);
      std::lock_guard<std::mutex> lock(mu_);
      for (auto& p : peers_)
        if (p->address == a.address && !p->self) {
          MarkDown(*p);
          p->cv.notify_all();
        }
      continue;
    }
    if (there.ok() && !there->standby() && there->generation() > a.generation) {
      Fence(a.key, there->generation());
      return absl::FailedPreconditionError(
          absl::StrCat("sequence ", Quote(a.key.id), " failed over to another replica (generation ",
                       there->generation(), "); this replica's copy was dropped"));
    }
    // Its copy there answered (and granted the lease), or it holds none (a standby that
    // restarted: nothing there to promote; the peer's thread copies it again).
    if (!there.ok() && !absl::IsNotFound(there.status())) continue;
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = seqs_.find(a.key); it != seqs_.end()) {
      it->second.heard = Clock::now();
      Renew(it->second, sent);
    }
  }
  if (!leases) return absl::OkStatus();
  // A standby not asked (down a while) whose lease ran out: gone for good if its address
  // refuses connections (a process that died: its copies died with it, none can be promoted).
  std::vector<std::string> down;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto now = Clock::now();
    for (const SequenceKey& k : keys)
      if (auto it = seqs_.find(k); it != seqs_.end() && it->second.peer >= 0 && it->second.opened &&
                                   it->second.leased_until <= now)
        down.push_back(peers_[it->second.peer]->address);
  }
  std::set<std::string> gone;
  for (const std::string& address : std::set<std::string>(down.begin(), down.end()))
    if (client::RefusesConnections(address, std::chrono::milliseconds(200))) gone.insert(address);
  std::lock_guard<std::mutex> lock(mu_);
  const auto now = Clock::now();
  Clock::time_point first{};
  for (const SequenceKey& k : keys) {
    auto it = seqs_.find(k);
    if (it == seqs_.end() || it->second.peer < 0 || !it->second.opened) continue;
    Seq& s = it->second;
    if (s.leased_until <= now && gone.contains(peers_[s.peer]->address)) Renew(s, now);
    if (s.leased_until <= now)
      return absl::UnavailableError(absl::StrCat(
          "sequence ", Quote(k.id), ": this replica holds no lease from its standby ",
          peers_[s.peer]->name, " (no answer for ",
          std::chrono::duration_cast<std::chrono::milliseconds>(now - s.heard).count(),
          " ms); it serves the sequence again once the standby answers, or fail it over "
          "(docs/replication.md#leases)"));
    if (first == Clock::time_point{} || s.leased_until < first) first = s.leased_until;
  }
  if (commit_by != nullptr) *commit_by = first;
  return absl::OkStatus();
}

uint64_t Replicator::FencedAt(const SequenceKey& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = fenced_.find(key);
  return it == fenced_.end() ? 0 : it->second;
}

void Replicator::Fence(const SequenceKey& key, uint64_t generation) {
  std::vector<std::function<void()>> run;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = seqs_.find(key);
    if (it != seqs_.end()) {
      Settle(it->second, &run, /*all=*/true,
             absl::FailedPreconditionError(absl::StrCat(
                 "sequence ", Quote(key.id), " failed over to another replica (generation ",
                 generation, "); this replica's copy is dropped and the step does not count")));
      if (it->second.queued) {
        auto& q = peers_[it->second.peer]->queue;
        q.erase(std::find(q.begin(), q.end(), key));
      }
      seqs_.erase(it);
    }
    if (fenced_.insert_or_assign(key, generation).second) fenced_order_.push_back(key);
    while (fenced_order_.size() > kMaxFenced) {
      fenced_.erase(fenced_order_.front());
      fenced_order_.pop_front();
    }
    ++totals_.fenced;
  }
  for (auto& f : run) f();
  LOG(WARNING) << "sequence " << Quote(key.id) << " (tenant " << Quote(key.tenant)
               << ") was promoted on another replica (generation " << generation
               << "): this replica's copy is fenced and dropped";
  if (!engine_->CloseSequence(key).ok()) {
    std::lock_guard<std::mutex> lock(mu_);
    to_close_.push_back(key);  // in a step now: closed by housekeeping
  }
}

}  // namespace attnd
