#include "cluster/replication.h"

#include <glog/logging.h>

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "cluster/drain.h"
#include "cluster/export_chunk.h"
#include "common/client_text.h"
#include "common/status_macros.h"
#include "kv_store/cache_layout.h"

namespace attnd {
namespace {

// LayerOutput.protection's words.
constexpr char kReplicated[] = "replicated", kShipping[] = "shipping",
               kUnprotected[] = "unprotected";

}  // namespace

absl::StatusOr<std::unique_ptr<Replicator>> Replicator::Create(Engine* engine,
                                                               ReplicationOptions options) {
  if (options.peers.empty()) return absl::InvalidArgumentError("--standby-peers: no peer given");
  if (options.max_lag_steps < 0)
    return absl::InvalidArgumentError("--replication-max-lag-steps: negative");
  for (const std::string& p : options.peers) {  // the form now; the names resolve later
    const size_t colon = p.rfind(':');
    int port = 0;
    if (colon == std::string::npos || colon == 0 || p.size() - colon > 6 ||
        !absl::SimpleAtoi(p.substr(colon + 1), &port) || port <= 0 || port > 65535 ||
        (p.rfind("dns:", 0) == 0 && colon <= 4))
      return absl::InvalidArgumentError(absl::StrCat("--standby-peers: '", p.substr(0, 100),
                                                     "' is neither HOST:PORT nor dns:NAME:PORT"));
  }
  std::unique_ptr<Replicator> r(new Replicator(engine, std::move(options)));
  r->AddPeers();  // what resolves now; housekeeping looks again every few seconds
  r->housekeeping_ = std::thread([r = r.get()] { r->Housekeeping(); });
  return r;
}

void Replicator::AddPeers() {
  // A headless Service resolves to the pods that are ready: peers come (and go) after start.
  auto addresses = DrainPeers(options_.peers);
  if (!addresses.ok()) {
    LOG_EVERY_N(WARNING, 30) << "standby peers: " << addresses.status().message();
    return;
  }
  std::lock_guard<std::mutex> lock(mu_);
  if (stop_) return;
  for (std::string& a : *addresses) {
    if (std::any_of(peers_.begin(), peers_.end(), [&](const auto& p) { return p->address == a; }))
      continue;
    auto p = std::make_unique<Peer>();
    p->address = std::move(a);
    Peer* raw = p.get();
    peers_.push_back(std::move(p));
    raw->thread = std::thread([this, raw] { PeerLoop(raw); });
  }
}

Replicator::Replicator(Engine* engine, ReplicationOptions options)
    : engine_(engine), options_(std::move(options)) {
  const CacheLayout c = CacheLayout::ForModel(engine->spec(), engine->options().cache_dtype, 0);
  bytes_per_token_ = static_cast<int64_t>(c.BytesPerPage()) / engine->spec().page_size;
}

Replicator::~Replicator() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
    for (auto& p : peers_) p->cv.notify_all();
    cv_.notify_all();
  }
  if (housekeeping_.joinable()) housekeeping_.join();  // (it adds peers: first)
  for (auto& p : peers_)
    if (p->thread.joinable()) p->thread.join();
  // Replies still waiting go now (their steps committed here).
  std::vector<std::function<void()>> run;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [key, s] : seqs_) Settle(s, &run, /*all=*/true);
  }
  for (auto& f : run) f();
}

int Replicator::ChoosePeer(const SequenceKey& key, const std::string& avoid) const {
  std::vector<PeerCandidate> candidates;
  candidates.reserve(peers_.size());
  for (const auto& p : peers_) candidates.push_back({p->name, !p->self && !p->failed});
  return RankStandby(candidates, options_.self_name, key.id, avoid);
}

void Replicator::MarkDown(Peer& p) {
  if (p.up) p.down_since = Clock::now();
  p.up = false;
  p.failed = true;
}

void Replicator::Renew(Seq& s, Clock::time_point sent) const {
  if (options_.lease.count() > 0)
    s.leased_until = std::max(s.leased_until, sent + options_.lease * 3 / 4);
}

void Replicator::Wake(const SequenceKey& key, Seq& s) {
  if (s.peer < 0 || s.queued) return;
  s.queued = true;
  peers_[s.peer]->queue.push_back(key);
  peers_[s.peer]->cv.notify_all();
}

void Replicator::Release(const std::shared_ptr<Pending>& p,
                         std::vector<std::function<void()>>* run) {
  if (--p->left != 0) return;
  if (p->status.ok())
    for (const std::string& word : p->protection) {
      if (word == kReplicated) ++totals_.replicated;
      if (word == kShipping) ++totals_.shipping;
      if (word == kUnprotected) ++totals_.unprotected_commits;
    }
  run->push_back([p] { p->then(p->status, std::move(p->protection)); });
}

void Replicator::Settle(Seq& s, std::vector<std::function<void()>>* run, bool all,
                        const absl::Status& why) {
  while (!s.commits.empty() && (all || s.commits.front() <= s.shipped)) s.commits.pop_front();
  auto keep = s.waiters.begin();
  for (auto it = s.waiters.begin(); it != s.waiters.end(); ++it) {
    if (all || it->target <= s.shipped) {
      if (!why.ok() && it->pending->status.ok()) it->pending->status = why;
      // Let go before its standby acknowledged (shutdown, a close): nothing protects it.
      if (it->target > s.shipped) it->pending->protection[it->index] = kUnprotected;
      Release(it->pending, run);
    } else {
      *keep++ = std::move(*it);
    }
  }
  s.waiters.erase(keep, s.waiters.end());
}

void Replicator::Track(const SequenceKey& key, uint64_t generation, int64_t length,
                       const std::string& avoid) {
  std::lock_guard<std::mutex> lock(mu_);
  if (fenced_.erase(key) > 0)
    fenced_order_.erase(std::find(fenced_order_.begin(), fenced_order_.end(), key));
  auto [it, fresh] = seqs_.try_emplace(key);
  if (!fresh) {
    Seq& old = it->second;
    if (old.closed) {  // closed while its round runs; opened again: a new copy after it
      old.reopened = true;
      old.reopened_committed = false;
      old.generation = generation;
      old.reopened_length = length;
      old.reopened_avoid = avoid;
    }
    return;
  }
  Seq& s = it->second;
  s.generation = generation;
  s.avoid = avoid;
  s.caught_up = length == 0;
  s.peer = ChoosePeer(key, avoid);
  Wake(key, s);  // opens the copy and sends what it holds already (a fork's, a promotion's)
}

void Replicator::Closed(const SequenceKey& key) {
  std::vector<std::function<void()>> run;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = seqs_.find(key);
    if (it == seqs_.end()) return;
    Seq& s = it->second;
    Settle(s, &run, /*all=*/true);
    if (s.busy) {
      s.closed = true;  // the peer's thread closes the copy after its send
      s.reopened = false;
    } else {
      if (s.peer >= 0 && s.opened) {
        peers_[s.peer]->closes.emplace_back(key, s.generation);
        peers_[s.peer]->cv.notify_all();
      }
      if (s.queued) {
        auto& q = peers_[s.peer]->queue;
        q.erase(std::find(q.begin(), q.end(), key));
      }
      seqs_.erase(it);
    }
  }
  for (auto& f : run) f();
}

void Replicator::Forget(const SequenceKey& key) {
  std::vector<std::function<void()>> run;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = seqs_.find(key);
    if (it == seqs_.end()) return;
    Settle(it->second, &run, /*all=*/true);
    if (it->second.queued) {
      auto& q = peers_[it->second.peer]->queue;
      q.erase(std::find(q.begin(), q.end(), key));
      it->second.queued = false;
    }
    if (it->second.busy) {
      it->second.closed = true;
      it->second.reopened = false;
      it->second.forgotten = true;  // nothing to close there
    } else {
      seqs_.erase(it);
    }
  }
  for (auto& f : run) f();
}

void Replicator::Committed(const std::vector<SequenceKey>& keys,
                           std::function<void(absl::Status, Protections)> then,
                           const std::vector<int64_t>* known) {
  // Lengths first, of the sequences replicated from here (a standby's imports are not): the
  // engine's lock is never taken under mu_.
  std::vector<bool> tracked(keys.size(), false);
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < keys.size(); ++i) tracked[i] = seqs_.contains(keys[i]);
  }
  std::vector<int64_t> lengths(keys.size(), -1);
  for (size_t i = 0; i < keys.size(); ++i) {
    if (!tracked[i]) continue;
    if (known != nullptr) {
      lengths[i] = (*known)[i];
    } else if (auto info = engine_->DescribeSequence(keys[i]); info.ok()) {
      lengths[i] = info->length;
    }
  }
  auto p = std::make_shared<Pending>();
  p->then = std::move(then);
  p->protection.assign(keys.size(), "");
  const bool sync = options_.mode == ReplicationOptions::Mode::kSync;
  std::vector<std::function<void()>> run;
  {
    std::lock_guard<std::mutex> lock(mu_);
    const auto now = Clock::now();
    for (size_t i = 0; i < keys.size(); ++i) {
      auto it = seqs_.find(keys[i]);
      if (it == seqs_.end() || lengths[i] < 0) continue;  // a standby copy, or closed meanwhile
      Seq& s = it->second;
      std::string& protection = p->protection[i];
      protection = kUnprotected;
      if (s.closed) {
        // Closed while its round is in flight and opened again (a new sequence under the same
        // id): none of it was sent; its own copy starts when that round ends (issue 53: this
        // was "replicated" against the old copy's rows).
        s.reopened_committed = true;
        continue;
      }
      if (s.peer < 0) continue;  // no standby: nothing to wait for
      if (lengths[i] <= s.shipped) {
        protection = kReplicated;
        continue;
      }
      Wake(keys[i], s);
      // A standby that left commits unacknowledged for ack_timeout holds nothing back (and no
      // commit is counted against it: the lag would grow while it is away); it catches up
      // when it answers. One whose last call merely failed still does, for ack_timeout.
      if (peers_[s.peer]->degraded) continue;
      // A sharded step's commit comes once per shard's reply: it is one commit.
      if (s.commits.empty() || s.commits.back() < lengths[i]) s.commits.push_back(lengths[i]);
      if (!s.caught_up) continue;  // its copy is being made: unprotected until it catches up
      // Sync: replicated once the reply goes (a wait that times out makes it unprotected).
      // Async: on its way while the standby answers.
      protection = sync ? kReplicated : peers_[s.peer]->up ? kShipping : kUnprotected;
      const int64_t lag = static_cast<int64_t>(s.commits.size());
      int64_t target = -1;
      if (sync) {
        target = lengths[i];
      } else if (lag > options_.max_lag_steps) {
        target = s.commits[static_cast<size_t>(lag - 1 - options_.max_lag_steps)];
      }
      if (target < 0) continue;
      ++p->left;
      s.waiters.push_back({target, p, now, i});
    }
    Release(p, &run);
  }
  for (auto& f : run) f();
}

std::string Replicator::StandbyOf(const SequenceKey& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = seqs_.find(key);
  if (it == seqs_.end() || it->second.peer < 0) return "";
  return peers_[it->second.peer]->name;
}

absl::Status Replicator::Flush(const SequenceKey& key,
                               std::chrono::steady_clock::time_point deadline) {
  for (;;) {
    auto info = engine_->DescribeSequence(key);
    if (!info.ok()) return info.status();
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = seqs_.find(key);
      if (it == seqs_.end()) return absl::NotFoundError("not replicated");
      const Seq& s = it->second;
      if (s.peer < 0) return absl::UnavailableError("no standby");
      if (s.opened && !s.busy && s.shipped >= info->length) return absl::OkStatus();
      Wake(key, it->second);
    }
    if (Clock::now() >= deadline) return absl::DeadlineExceededError("standby still behind");
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
}

ReplicationStats Replicator::Stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  ReplicationStats r = totals_;
  for (const auto& p : peers_)
    if (!p->self && !p->name.empty()) r.peers.push_back(p->name);
  for (const auto& [key, s] : seqs_) {
    const bool covered =
        s.peer >= 0 && s.opened && s.caught_up && peers_[s.peer]->up && !peers_[s.peer]->degraded;
    ++(covered ? r.sequences : r.unprotected);
    r.lag_steps = std::max<int64_t>(r.lag_steps, static_cast<int64_t>(s.commits.size()));
    if (!s.commits.empty()) r.lag_bytes += (s.commits.back() - s.shipped) * bytes_per_token_;
  }
  return r;
}

void Replicator::Housekeeping() {
  auto last_reconcile = Clock::now(), last_resolve = Clock::now();
  for (;;) {
    if (Clock::now() - last_resolve > std::chrono::seconds(2)) {
      last_resolve = Clock::now();
      AddPeers();
    }
    std::vector<std::function<void()>> run;
    std::vector<SequenceKey> check, closing;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, std::chrono::milliseconds(20), [&] { return stop_; });
      if (stop_) return;
      const auto now = Clock::now();
      // Replies waiting longer than ack_timeout go unprotected (a standby that does not answer
      // must not stop the primary).
      int64_t degraded = 0;
      for (auto& [key, s] : seqs_) {
        if (s.waiters.empty() || now - s.waiters.front().since < options_.ack_timeout) continue;
        for (Waiter& w : s.waiters) {
          w.pending->protection[w.index] = kUnprotected;
          Release(w.pending, &run);
        }
        degraded += static_cast<int64_t>(s.waiters.size());
        s.waiters.clear();
        s.commits.clear();  // unprotected now: its lag is no longer counted
        if (s.peer >= 0 && !peers_[s.peer]->degraded) {
          peers_[s.peer]->degraded = true;
          LOG(WARNING) << "standby peer " << peers_[s.peer]->name << " acknowledged nothing for "
                       << options_.ack_timeout.count()
                       << " ms: commits answer without waiting for it until it does";
        }
      }
      if (degraded > 0) {
        totals_.degraded += degraded;
        LOG_EVERY_N(WARNING, 20) << degraded << " commit(s) answered without their standby's "
                                 << "acknowledgement (no answer within "
                                 << options_.ack_timeout.count() << " ms)";
      }
      // A copy on a peer down for long moves to the next one.
      for (auto& [key, s] : seqs_) {
        if (s.busy) continue;
        const bool down = s.peer >= 0 && !peers_[s.peer]->up &&
                          now - peers_[s.peer]->down_since > 5 * options_.ack_timeout;
        if (s.peer >= 0 && !down) continue;
        const int next = ChoosePeer(key, s.avoid);
        if (next < 0 || next == s.peer) continue;
        if (s.peer >= 0 && s.opened) peers_[s.peer]->closes.emplace_back(key, s.generation);
        if (s.queued) {
          auto& q = peers_[s.peer]->queue;
          q.erase(std::find(q.begin(), q.end(), key));
          s.queued = false;
        }
        s.peer = next;
        s.opened = false;
        s.shipped = 0;
        s.caught_up = false;
        Wake(key, s);
      }
      closing.swap(to_close_);
      if (now - last_reconcile > std::chrono::seconds(1)) {
        last_reconcile = now;
        for (const auto& [key, s] : seqs_) check.push_back(key);
      }
    }
    for (auto& f : run) f();
    for (const SequenceKey& k : closing)
      if (!engine_->CloseSequence(k).ok() && engine_->DescribeSequence(k).ok()) {
        std::lock_guard<std::mutex> lock(mu_);
        to_close_.push_back(k);
      }
    // Sequences closed here without the service (idle expiry): their copies close too.
    for (const SequenceKey& k : check)
      if (absl::IsNotFound(engine_->DescribeSequence(k).status())) Closed(k);
  }
}

}  // namespace attnd
