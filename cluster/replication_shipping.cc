// The replicator's shipping (cluster/replication.h): resolving and reaching each standby peer,
// the peer's loop, and a round that ships its sequences' new rows as batched write-only steps.
// Moved out of replication.cc unchanged.
#include <glog/logging.h>

#include <algorithm>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "client/router.h"
#include "cluster/drain.h"
#include "cluster/export_chunk.h"
#include "cluster/replication.h"
#include "common/client_text.h"
#include "common/status_macros.h"
#include "kv_store/cache_layout.h"

namespace attnd {
namespace {

// Appends one sequence's rows (an export chunk's tensors) to a layer message of a batched
// write-only step: the tensors' rows follow each other in batch order.
void AppendRows(const v1::LayerInputs& from, v1::LayerInputs* to) {
  auto append = [](const v1::Tensor& a, v1::Tensor* b) {
    if (b->shape_size() == 0) {
      *b = a;
      return;
    }
    b->set_shape(0, b->shape(0) + a.shape(0));
    b->mutable_data()->append(a.data());
    if (a.has_scales()) {
      b->mutable_scales()->set_shape(0, b->scales().shape(0) + a.scales().shape(0));
      b->mutable_scales()->mutable_data()->append(a.scales().data());
    }
  };
  to->set_layer(from.layer());
  append(from.kv_latent(), to->mutable_kv_latent());
  append(from.k_rope(), to->mutable_k_rope());
  if (from.has_index_k()) append(from.index_k(), to->mutable_index_k());
}

int64_t TensorBytes(const v1::LayerInputs& in) {
  auto bytes = [](const v1::Tensor& t) {
    return static_cast<int64_t>(t.data().size() + t.scales().data().size());
  };
  return bytes(in.kv_latent()) + bytes(in.k_rope()) + bytes(in.index_k());
}

}  // namespace

bool Replicator::Resolve(Peer* peer) {
  client::ConnectOptions c = options_.credentials;
  c.call_timeout_ms = options_.ack_timeout.count();
  c.reconnect_backoff_ms = 50;
  auto cl = client::Client::Connect(peer->address, c);
  if (!cl.ok()) return false;
  auto info = (*cl)->Info();
  if (!info.ok()) return false;
  const std::string name = info->replica_name().empty() ? peer->address : info->replica_name();
  std::lock_guard<std::mutex> lock(mu_);
  peer->name = name;
  peer->self = name == options_.self_name;
  peer->up = !peer->self;
  if (!peer->self) LOG(INFO) << "standby peer " << name << " (" << peer->address << ") answers";
  // Sequences without a standby may have one now.
  for (auto& [key, s] : seqs_)
    if (s.peer < 0) {
      s.peer = ChoosePeer(key, s.avoid);
      Wake(key, s);
    }
  return true;
}

absl::StatusOr<client::Client*> Replicator::ClientFor(Peer* peer, const std::string& tenant) {
  auto it = peer->clients.find(tenant);
  if (it != peer->clients.end()) return it->second.get();
  client::ConnectOptions c = options_.credentials;
  c.act_as_tenant = tenant;
  c.call_timeout_ms = options_.ack_timeout.count();
  c.reconnect_backoff_ms = 50;
  ASSIGN_OR_RETURN(std::unique_ptr<client::Client> cl, client::Client::Connect(peer->address, c));
  return (peer->clients[tenant] = std::move(cl)).get();
}

void Replicator::PeerLoop(Peer* peer) {
  auto backoff = std::chrono::milliseconds(20);
  for (;;) {
    {
      std::unique_lock<std::mutex> lock(mu_);
      peer->cv.wait_for(lock, std::chrono::milliseconds(200), [&] {
        return stop_ || (!peer->name.empty() && (!peer->queue.empty() || !peer->closes.empty()));
      });
      if (stop_) return;
    }
    bool ok;
    if (peer->name.empty()) {
      ok = Resolve(peer);
      std::lock_guard<std::mutex> lock(mu_);
      if (peer->self) return;
    } else {
      const Round r = Ship(peer);
      if (r == Round::kRetry) {
        std::unique_lock<std::mutex> lock(mu_);
        peer->cv.wait_for(lock, std::chrono::milliseconds(100), [&] { return stop_; });
        continue;
      }
      if (r == Round::kIdle) {
        // Nothing to send: a peer is asked for its ServerInfo when it last answered an ack
        // timeout ago (so one that died between commits is found down before a commit waits
        // for it, and its copies move on), and one found down until it answers.
        bool down;
        Clock::time_point heard;
        {
          std::lock_guard<std::mutex> lock(mu_);
          down = !peer->up;
          heard = peer->heard;
        }
        if (!down && Clock::now() - heard < options_.ack_timeout) continue;
        auto cl = ClientFor(peer, "");
        ok = cl.ok() && (*cl)->Info().ok();
      } else {
        ok = r == Round::kOk;
      }
    }
    std::unique_lock<std::mutex> lock(mu_);
    if (ok) {
      peer->heard = Clock::now();
      if (!peer->up && !peer->name.empty())
        LOG(INFO) << "standby peer " << peer->name << " answers again";
      peer->up = !peer->name.empty();
      peer->failed = false;
      if (peer->degraded && !peer->name.empty()) {
        peer->degraded = false;
        LOG(INFO) << "standby peer " << peer->name << " acknowledges again: commits wait for it";
      }
      backoff = std::chrono::milliseconds(20);
      continue;
    }
    ++totals_.errors;
    MarkDown(*peer);
    peer->clients.clear();  // reconnect
    peer->cv.wait_for(lock, backoff, [&] { return stop_; });
    backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
  }
}

Replicator::Round Replicator::Ship(Peer* peer) {
  const Clock::time_point round_start = Clock::now();  // leases run from before any call
  // Closes first (a close and a reopen of one id go in that order).
  std::vector<std::pair<SequenceKey, uint64_t>> closes;
  {
    std::lock_guard<std::mutex> lock(mu_);
    closes.swap(peer->closes);
  }
  for (size_t i = 0; i < closes.size(); ++i) {
    const auto& [key, generation] = closes[i];
    auto cl = ClientFor(peer, key.tenant);
    // Only the standby copy at its generation: a copy promoted there since (this replica was
    // cut off while it failed over) is the sequence now, and stays.
    absl::Status s = cl.ok() ? (*cl)->CloseSequence(key.id, generation) : cl.status();
    if (absl::IsFailedPrecondition(s)) {
      auto there = (*cl)->DescribeSequence(key.id);
      if (absl::IsNotFound(there.status()) ||
          (there.ok() && (!there->standby() || there->generation() != generation)))
        s = absl::OkStatus();  // not our copy (any more)
    }
    if (!s.ok() && !absl::IsNotFound(s)) {
      std::lock_guard<std::mutex> lock(mu_);
      peer->closes.insert(peer->closes.end(), closes.begin() + i, closes.end());
      return Round::kFailed;
    }
  }
  // Then one batch of one tenant's sequences.
  struct Item {
    SequenceKey key;
    uint64_t generation = 0;
    bool opened = false;
    int64_t shipped = 0;
    int64_t length = -1;  // its committed tokens; -1: not looked at this round (left for the next)
    int64_t n = 0;        // rows in this step
    bool heard = false;   // the standby confirmed its copy at our generation this round
  };
  std::vector<Item> items;
  {
    std::lock_guard<std::mutex> lock(mu_);
    std::deque<SequenceKey> rest;
    while (!peer->queue.empty()) {
      SequenceKey k = std::move(peer->queue.front());
      peer->queue.pop_front();
      auto it = seqs_.find(k);
      if (it == seqs_.end()) continue;
      if (static_cast<int64_t>(items.size()) >= options_.max_batch_entries ||
          (!items.empty() && k.tenant != items[0].key.tenant)) {
        rest.push_back(std::move(k));
        continue;
      }
      Seq& s = it->second;
      s.queued = false;
      s.busy = true;
      items.push_back({k, s.generation, s.opened, s.shipped});
    }
    peer->queue.swap(rest);
  }
  if (items.empty() && closes.empty()) return Round::kIdle;
  if (items.empty()) return Round::kOk;
  auto cl = ClientFor(peer, items[0].key.tenant);
  // Ends the round: records what the standby acknowledged, requeues what is left.
  auto finish = [&](bool ok) -> Round {
    std::vector<std::function<void()>> run;
    std::vector<SequenceKey> gone;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (Item& item : items) {
        auto it = seqs_.find(item.key);
        if (it == seqs_.end()) continue;
        Seq& s = it->second;
        s.busy = false;
        s.opened = item.opened;
        s.shipped = item.shipped;
        if (ok && s.opened && item.length >= 0 && s.shipped >= item.length) s.caught_up = true;
        if (item.heard) {
          s.heard = Clock::now();
          Renew(s, round_start);
        }
        if (!s.opened) s.caught_up = false;
        Settle(s, &run);
        if (s.closed) {
          Settle(s, &run, /*all=*/true);  // a commit waiting on it answers (unprotected)
          if (s.opened && !s.forgotten) peer->closes.emplace_back(item.key, item.generation);
          if (s.queued) {  // woken during the round
            auto& q = peers_[s.peer]->queue;
            if (auto at = std::find(q.begin(), q.end(), item.key); at != q.end()) q.erase(at);
          }
          if (s.reopened) {  // opened again meanwhile: a new copy, after the close above
            Seq fresh;
            fresh.generation = s.generation;
            fresh.avoid = s.reopened_avoid;
            fresh.caught_up = s.reopened_length == 0 && !s.reopened_committed;
            fresh.peer = ChoosePeer(item.key, fresh.avoid);
            s = std::move(fresh);
            Wake(item.key, s);
            continue;
          }
          seqs_.erase(it);
          continue;
        }
        if (!ok || item.length < 0 || s.shipped < item.length || !s.opened ||
            (!s.commits.empty() && s.commits.back() > s.shipped))
          Wake(item.key, s);
      }
      if (!peer->queue.empty() || !peer->closes.empty()) peer->cv.notify_all();
    }
    for (auto& f : run) f();
    return ok ? Round::kOk : Round::kFailed;
  };
  if (!cl.ok()) return finish(false);
  client::Client& to = **cl;
  const int64_t chunk = std::max<int64_t>(1, options_.chunk_tokens);
  int64_t budget = peer->batch_tokens > 0 ? peer->batch_tokens : chunk;
  std::vector<Item*> sending;
  for (Item& item : items) {
    auto info = engine_->DescribeSequence(item.key);
    if (!info.ok()) {  // closed here meanwhile (an expiry): close the copy
      std::lock_guard<std::mutex> lock(mu_);
      if (auto it = seqs_.find(item.key); it != seqs_.end()) it->second.closed = true;
      continue;
    }
    item.length = info->length;
    // A spilled sequence's rows are read where they are (Engine::ReadRows), never brought back
    // to the device for its copy. A lost one has none to read (every use of it says DATA_LOSS
    // until the worker closes it and prefills again): its copy is closed.
    if (info->lost) {
      std::lock_guard<std::mutex> lock(mu_);
      if (auto it = seqs_.find(item.key); it != seqs_.end()) it->second.closed = true;
      continue;
    }
    if (!item.opened) {
      v1::OpenSequenceRequest req;
      req.set_sequence_id(item.key.id);
      req.set_standby_generation(item.generation);
      req.set_lease_ms(options_.lease.count());
      absl::Status s = to.OpenSequence(req).status();
      if (absl::IsAlreadyExists(s)) {  // left from before (a lost reply, a reconnect)
        auto there = to.DescribeSequence(item.key.id, options_.lease.count());
        if (!there.ok()) return finish(false);
        if (there->standby() && there->generation() == item.generation &&
            there->length() <= item.length) {
          item.shipped = there->length();
          s = absl::OkStatus();
        } else if (!there->standby() || there->generation() > item.generation) {
          Fence(item.key, there->generation());
          continue;
        } else {
          (void)to.CloseSequence(item.key.id, there->generation());  // an older run's copy
          s = to.OpenSequence(req).status();
        }
      }
      if (!s.ok()) {
        LOG_EVERY_N(WARNING, 100) << "standby copy of " << Quote(item.key.id) << " on "
                                  << peer->name << " not opened: " << s.message();
        return finish(false);
      }
      item.opened = true;
      item.heard = true;
    }
    item.n = std::min(item.length - item.shipped, budget);
    if (item.n <= 0) continue;
    budget -= item.n;
    sending.push_back(&item);
    if (budget == 0) break;
  }
  if (sending.empty()) return finish(true);
  v1::BeginStepRequest begin;
  begin.set_write_only(true);
  begin.set_lease_ms(options_.lease.count());
  for (const Item* item : sending) {
    v1::BatchEntry* e = begin.add_batch();
    e->set_sequence_id(item->key.id);
    e->set_q_len(item->n);
    e->set_generation(item->generation);
    // Rows after what the copy holds: a step it took whose reply was lost (a deadline, a
    // dropped connection) is refused when sent again, and the length read back below.
    e->set_start(item->shipped);
    // The blocks they complete, when this replica knows them all: the copy keeps them, and
    // indexes them once promoted (its prefix cache and KV events).
    if (auto hashes =
            engine_->CompletedBlockHashes(item->key, item->shipped, item->shipped + item->n);
        hashes.ok())
      for (const BlockHash& h : *hashes)
        e->add_block_hashes(reinterpret_cast<const char*>(h.data()), h.size());
  }
  // The begin and every layer on one Step call, bounded by the ack timeout.
  std::unique_ptr<client::StepStream> stream = to.OpenStream(options_.ack_timeout.count());
  absl::Status failed = stream->Begin(begin).status();
  bool read_failed = false;  // here, not there
  int64_t bytes = 0, tokens = 0;
  for (const Item* item : sending) tokens += item->n;
  const int layers = engine_->spec().num_layers();
  v1::ExportChunk rows;
  for (int layer = 0; failed.ok() && layer < layers; ++layer) {
    v1::LayerInputs in;
    for (const Item* item : sending) {
      if (absl::Status s = ReadExportChunk(*engine_, item->key, layer, item->shipped, item->n,
                                           item->length, &rows);
          !s.ok()) {
        failed = s;
        read_failed = true;
        (void)stream->Abort();
        break;
      }
      AppendRows(rows.keys(), &in);
    }
    if (!failed.ok()) break;
    bytes += TensorBytes(in);
    failed = stream->Layer(in).status();
  }
  if (failed.ok()) {
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (Item* item : sending) {
        item->shipped += item->n;
        item->heard = true;
        totals_.rows_shipped += item->n;
      }
      totals_.bytes_shipped += bytes;
      ++totals_.steps_shipped;
    }
    if (peer->batch_tokens > 0) peer->batch_tokens = std::min(chunk, 2 * peer->batch_tokens);
    const Round r = finish(true);  // the commit's waiters go before the call is closed
    (void)stream->Close();
    return r;
  }
  if (read_failed) {
    // This replica could not read the rows (a tier full, a move that did not end in time): the
    // peer is fine. Nothing was committed there (the step was aborted); again shortly
    // (a sequence lost or closed here meanwhile is seen then).
    LOG_EVERY_N(WARNING, 100) << "replication to " << peer->name
                              << ": reading the rows to send: " << failed.message();
    finish(true);
    return Round::kRetry;
  }
  if (absl::IsFailedPrecondition(failed) || absl::IsNotFound(failed) || absl::IsCancelled(failed)) {
    // Which copy refused (or whose promotion aborted this step there): one promoted elsewhere
    // is fenced; a missing one is opened again. The peer itself answered.
    for (Item* item : sending) {
      auto there = to.DescribeSequence(item->key.id);
      if (absl::IsNotFound(there.status())) {
        item->opened = false;
        item->shipped = 0;
      } else if (there.ok() && (!there->standby() || there->generation() != item->generation)) {
        Fence(item->key, there->generation());
      } else if (there.ok()) {
        item->shipped = there->length();  // a step of ours it committed before a lost reply
      }
    }
    return finish(true);
  }
  if (absl::IsResourceExhausted(failed) && tokens > 1) {
    // The peer's cache cannot take a step this large now (a new copy of many sequences at
    // once, a standby with little room): fewer tokens a step, at once. One token it cannot take
    // is a full peer, as below.
    peer->batch_tokens = tokens / 2;
    LOG_EVERY_N(INFO, 100) << "replication to " << peer->name << ": " << failed.message()
                           << "; steps of at most " << peer->batch_tokens << " tokens now";
    return finish(true);
  }
  LOG_EVERY_N(WARNING, 100) << "replication to " << peer->name << ": " << failed.message();
  return finish(false);
}

}  // namespace attnd
