#include "client/kv_events.h"

#include <algorithm>
#include <cstring>
#include <msgpack.hpp>
#include <zmq.hpp>

#include "absl/strings/str_cat.h"

namespace attnd::client {

namespace {

absl::Status Bad(const std::string& what) {
  return absl::InvalidArgumentError(absl::StrCat("KV event batch: ", what));
}

bool IsArray(const msgpack::object& o) { return o.type == msgpack::type::ARRAY; }

absl::StatusOr<std::string> Str(const msgpack::object& o) {
  if (o.type != msgpack::type::STR) return Bad("expected a string");
  return std::string(o.via.str.ptr, o.via.str.size);
}

absl::StatusOr<int64_t> Int(const msgpack::object& o) {
  if (o.type == msgpack::type::POSITIVE_INTEGER) return static_cast<int64_t>(o.via.u64);
  if (o.type == msgpack::type::NEGATIVE_INTEGER) return o.via.i64;
  return Bad("expected an integer");
}

absl::StatusOr<BlockHash> Hash(const msgpack::object& o) {
  BlockHash h{};
  if (o.type == msgpack::type::BIN && o.via.bin.size == h.size()) {
    std::memcpy(h.data(), o.via.bin.ptr, h.size());
    return h;
  }
  return Bad("a block hash is 32 raw bytes");
}

absl::StatusOr<std::vector<BlockHash>> Hashes(const msgpack::object& o) {
  if (!IsArray(o)) return Bad("block_hashes: expected an array");
  std::vector<BlockHash> out;
  for (uint32_t i = 0; i < o.via.array.size; ++i) {
    auto h = Hash(o.via.array.ptr[i]);
    if (!h.ok()) return h.status();
    out.push_back(*h);
  }
  return out;
}

// vLLM's fields of each event, in declaration order: a tagged map's fields are put in these
// places (as llm-d reads them), so both forms decode the same way. Unknown keys are ignored.
const std::vector<std::string>& FieldOrder(const std::string& tag) {
  static const std::vector<std::string> stored = {"block_hashes", "parent_block_hash", "token_ids",
                                                  "block_size",   "lora_id",           "medium"};
  static const std::vector<std::string> removed = {"block_hashes", "medium"};
  static const std::vector<std::string> none;
  return tag == "BlockStored" ? stored : tag == "BlockRemoved" ? removed : none;
}

absl::StatusOr<KvEvent> Event(const msgpack::object& o) {
  // f[0] the tag, f[1..] the fields in vLLM's order (nullptr: absent).
  std::vector<const msgpack::object*> f;
  if (IsArray(o) && o.via.array.size > 0) {
    for (uint32_t i = 0; i < o.via.array.size; ++i) f.push_back(&o.via.array.ptr[i]);
  } else if (o.type == msgpack::type::MAP) {
    auto key = [&](uint32_t i) { return Str(o.via.map.ptr[i].key); };
    for (uint32_t i = 0; i < o.via.map.size && f.empty(); ++i)
      if (auto k = key(i); k.ok() && *k == "type") f.push_back(&o.via.map.ptr[i].val);
    if (f.empty()) return Bad("a tagged map has a \"type\"");
    auto tag = Str(*f[0]);
    if (!tag.ok()) return tag.status();
    for (const std::string& name : FieldOrder(*tag)) {
      const msgpack::object* v = nullptr;
      for (uint32_t i = 0; i < o.via.map.size && v == nullptr; ++i)
        if (auto k = key(i); k.ok() && *k == name) v = &o.via.map.ptr[i].val;
      f.push_back(v);
    }
    while (f.size() > 1 && f.back() == nullptr) f.pop_back();
  } else {
    return Bad("an event is a tagged array or a tagged map");
  }
  const uint32_t n = static_cast<uint32_t>(f.size());
  auto tag = Str(*f[0]);
  if (!tag.ok()) return tag.status();
  KvEvent e;
  auto opt_str = [&](uint32_t i) -> std::string {
    return i < n && f[i] != nullptr && f[i]->type == msgpack::type::STR
               ? std::string(f[i]->via.str.ptr, f[i]->via.str.size)
               : std::string();
  };
  for (uint32_t i = 1; i < std::min(n, 5u); ++i)
    if (f[i] == nullptr) return Bad(absl::StrCat(*tag, ": a field is missing"));
  if (*tag == "AllBlocksCleared") {
    e.kind = KvEvent::Kind::kCleared;
    return e;
  }
  const bool stored = *tag == "BlockStored";
  if (!stored && *tag != "BlockRemoved") return Bad(absl::StrCat("unknown event '", *tag, "'"));
  if (n < (stored ? 5u : 2u)) return Bad(absl::StrCat(*tag, ": too few fields"));
  auto hashes = Hashes(*f[1]);
  if (!hashes.ok()) return hashes.status();
  e.hashes = *std::move(hashes);
  if (!stored) {
    e.kind = KvEvent::Kind::kRemoved;
    e.medium = opt_str(2);
    return e;
  }
  e.kind = KvEvent::Kind::kStored;
  if (f[2]->type != msgpack::type::NIL) {
    auto parent = Hash(*f[2]);
    if (!parent.ok()) return parent.status();
    e.parent = *parent;
  }
  if (!IsArray(*f[3])) return Bad("token_ids: expected an array");
  for (uint32_t i = 0; i < f[3]->via.array.size; ++i) {
    auto t = Int(f[3]->via.array.ptr[i]);
    if (!t.ok()) return t.status();
    e.tokens.push_back(static_cast<uint32_t>(*t));
  }
  auto bs = Int(*f[4]);
  if (!bs.ok()) return bs.status();
  e.block_size = *bs;
  e.medium = opt_str(6);
  return e;
}

}  // namespace

absl::StatusOr<KvEventBatch> DecodeKvEventBatch(const std::string& payload) {
  msgpack::object_handle oh;
  try {
    oh = msgpack::unpack(payload.data(), payload.size());
  } catch (const std::exception& e) {
    return Bad(absl::StrCat("not msgpack (", e.what(), ")"));
  }
  const msgpack::object& o = oh.get();
  if (!IsArray(o) || o.via.array.size < 2) return Bad("expected [ts, events, rank]");
  const msgpack::object* f = o.via.array.ptr;
  KvEventBatch b;
  if (f[0].type == msgpack::type::FLOAT64 || f[0].type == msgpack::type::FLOAT32)
    b.ts = f[0].via.f64;
  else
    return Bad("ts: expected a float");
  if (!IsArray(f[1])) return Bad("events: expected an array");
  for (uint32_t i = 0; i < f[1].via.array.size; ++i) {
    auto e = Event(f[1].via.array.ptr[i]);
    if (!e.ok()) return e.status();
    b.events.push_back(*std::move(e));
  }
  if (o.via.array.size > 2 && f[2].type != msgpack::type::NIL) {
    auto r = Int(f[2]);
    if (!r.ok()) return r.status();
    b.rank = *r;
  }
  return b;
}

absl::StatusOr<std::pair<std::string, std::string>> ParseKvTopic(const std::string& topic) {
  const size_t at = topic.find('@', 3);
  if (topic.rfind("kv@", 0) != 0 || at == std::string::npos ||
      topic.find('@', at + 1) != std::string::npos)
    return Bad(absl::StrCat("not an attnd topic: ", topic));
  std::string tenant;  // '%' and '@' come as %25 and %40
  for (size_t i = at + 1; i < topic.size(); ++i) {
    if (topic[i] != '%') {
      tenant += topic[i];
    } else if (topic.compare(i, 3, "%25") == 0 || topic.compare(i, 3, "%40") == 0) {
      tenant += topic[i + 2] == '5' ? '%' : '@';
      i += 2;
    } else {
      return Bad(absl::StrCat("a '%' not followed by 25 or 40 in ", topic));
    }
  }
  return std::make_pair(topic.substr(3, at - 3), tenant);
}

void KvBlockIndex::ClearLocked(const std::string& replica) {
  for (auto it = blocks_.begin(); it != blocks_.end();)
    it = it->first.first == replica ? blocks_.erase(it) : std::next(it);
  for (auto it = last_seq_.begin(); it != last_seq_.end();)
    it = it->first.first == replica ? last_seq_.erase(it) : std::next(it);
  stale_.erase(replica);
}

std::optional<uint64_t> KvBlockIndex::LastSeq(const std::string& replica,
                                              const std::string& tenant) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = last_seq_.find({replica, tenant});
  return it == last_seq_.end() ? std::nullopt : std::optional<uint64_t>(it->second);
}

void KvBlockIndex::Apply(const std::string& replica, const std::string& tenant, uint64_t seq,
                         const KvEventBatch& batch) {
  std::lock_guard<std::mutex> lock(mu_);
  auto last = last_seq_.find({replica, tenant});
  if (last != last_seq_.end() && seq <= last->second) {  // counting back: a restart
    ClearLocked(replica);
    ++restarts_;
  } else if (last != last_seq_.end() && seq != last->second + 1) {
    ++gaps_;
    stale_.insert(replica);
  }
  const int64_t device = batch.rank.value_or(-1);
  for (const KvEvent& e : batch.events) {
    if (e.kind == KvEvent::Kind::kCleared) {
      ClearLocked(replica);
      continue;
    }
    auto& held = blocks_[{replica, tenant}];
    for (const BlockHash& h : e.hashes) {
      if (e.kind == KvEvent::Kind::kStored) {
        held[h].insert(device);
      } else if (auto it = held.find(h); it != held.end()) {
        it->second.erase(device);
        if (it->second.empty()) held.erase(it);
      }
    }
  }
  last_seq_[{replica, tenant}] = seq;  // after the events: a cleared replica is known again
}

std::optional<int64_t> KvBlockIndex::CachedBlocks(const std::string& replica,
                                                  const std::string& tenant,
                                                  const std::vector<BlockHash>& hashes) const {
  std::lock_guard<std::mutex> lock(mu_);
  if (stale_.contains(replica) ||
      std::none_of(last_seq_.begin(), last_seq_.end(),
                   [&](const auto& kv) { return kv.first.first == replica; }))
    return std::nullopt;
  auto it = blocks_.find({replica, tenant});
  if (it == blocks_.end()) return 0;
  std::set<int64_t> devices;
  int64_t n = 0;
  for (const BlockHash& h : hashes) {
    auto held = it->second.find(h);
    if (held == it->second.end()) break;
    if (n == 0) {
      devices = held->second;
    } else {
      std::set<int64_t> both;
      for (int64_t d : devices)
        if (held->second.contains(d)) both.insert(d);
      devices.swap(both);
    }
    if (devices.empty()) break;
    ++n;
  }
  return n;
}

bool KvBlockIndex::stale(const std::string& replica) const {
  std::lock_guard<std::mutex> lock(mu_);
  return stale_.contains(replica);
}
int64_t KvBlockIndex::gaps() const {
  std::lock_guard<std::mutex> lock(mu_);
  return gaps_;
}
int64_t KvBlockIndex::restarts() const {
  std::lock_guard<std::mutex> lock(mu_);
  return restarts_;
}
size_t KvBlockIndex::blocks(const std::string& replica, const std::string& tenant) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = blocks_.find({replica, tenant});
  return it == blocks_.end() ? 0 : it->second.size();
}

struct KvEventSubscriber::Impl {
  zmq::context_t context{1};
  zmq::socket_t socket{context, zmq::socket_type::sub};
  std::map<std::string, std::string> replay;  // replica -> its replay endpoint
};

namespace {

uint64_t Be64(const zmq::message_t& m) {
  uint64_t v = 0;
  const auto* b = static_cast<const unsigned char*>(m.data());
  for (size_t i = 0; i < 8 && i < m.size(); ++i) v = (v << 8) | b[i];
  return v;
}

// Every multipart message a DEALER receives until the replay's end marker (or 2 s of silence).
std::vector<std::vector<zmq::message_t>> Replay(zmq::context_t& context,
                                                const std::string& endpoint, uint64_t start,
                                                const std::string& topic) {
  std::vector<std::vector<zmq::message_t>> out;
  zmq::socket_t s(context, zmq::socket_type::dealer);
  s.set(zmq::sockopt::linger, 0);
  s.set(zmq::sockopt::rcvtimeo, 2000);
  s.connect(endpoint);
  unsigned char be[8];
  for (int i = 0; i < 8; ++i) be[i] = static_cast<unsigned char>(start >> (56 - 8 * i));
  s.send(zmq::message_t(), zmq::send_flags::sndmore);
  s.send(zmq::buffer(be, 8), zmq::send_flags::sndmore);
  s.send(zmq::buffer(topic));
  for (;;) {
    std::vector<zmq::message_t> frames;
    zmq::message_t m;
    if (!s.recv(m)) return out;  // silence: what came is all there is
    frames.push_back(std::move(m));
    while (frames.back().more() && s.recv(m)) frames.push_back(std::move(m));
    // ["", topic, seq, payload]; the end: ["", "", 8 x 0xFF, ""].
    if (frames.size() != 4 || frames[2].size() != 8) return out;
    if (frames[1].size() == 0 && Be64(frames[2]) == ~uint64_t{0}) return out;
    out.push_back(std::move(frames));
  }
}

}  // namespace

KvEventSubscriber::KvEventSubscriber()
    : impl_(std::make_unique<Impl>()), index_(std::make_shared<KvBlockIndex>()) {}

absl::StatusOr<std::unique_ptr<KvEventSubscriber>> KvEventSubscriber::Start(
    const std::map<std::string, std::string>& endpoints,
    const std::map<std::string, std::string>& replay) {
  std::unique_ptr<KvEventSubscriber> s(new KvEventSubscriber());
  s->impl_->replay = replay;
  try {
    s->impl_->socket.set(zmq::sockopt::subscribe, "kv@");
    s->impl_->socket.set(zmq::sockopt::rcvtimeo, 100);
    s->impl_->socket.set(zmq::sockopt::linger, 0);
    for (const auto& [name, endpoint] : endpoints) s->impl_->socket.connect(endpoint);
  } catch (const zmq::error_t& e) {
    return absl::InvalidArgumentError(absl::StrCat("KV events: ", e.what()));
  }
  s->thread_ = std::thread([raw = s.get()] { raw->Loop(); });
  return s;
}

KvEventSubscriber::~KvEventSubscriber() {
  stop_ = true;
  if (thread_.joinable()) thread_.join();
}

void KvEventSubscriber::Loop() {
  while (!stop_) {
    std::vector<zmq::message_t> frames;
    try {
      zmq::message_t m;
      if (!impl_->socket.recv(m)) continue;  // timed out: look at stop_
      frames.push_back(std::move(m));
      while (frames.back().more()) {
        zmq::message_t next;
        if (!impl_->socket.recv(next)) break;
        frames.push_back(std::move(next));
      }
    } catch (const zmq::error_t&) {
      return;
    }
    if (frames.size() != 3 || frames[1].size() != 8) {
      ++errors_;
      continue;
    }
    auto topic = ParseKvTopic(frames[0].to_string());
    auto batch = DecodeKvEventBatch(frames[2].to_string());
    if (!topic.ok() || !batch.ok()) {
      ++errors_;
      continue;
    }
    const uint64_t seq = Be64(frames[1]);
    const auto last = index_->LastSeq(topic->first, topic->second);
    const auto replay = impl_->replay.find(topic->first);
    if (last && seq > *last + 1 && replay != impl_->replay.end()) {
      // Missed messages: what the replica's buffer still has of them comes first (with its
      // start's AllBlocksCleared when it restarted meanwhile).
      try {
        for (auto& r : Replay(impl_->context, replay->second, *last + 1, frames[0].to_string())) {
          auto t = ParseKvTopic(r[1].to_string());
          auto b = DecodeKvEventBatch(r[3].to_string());
          const uint64_t s = Be64(r[2]);
          if (!t.ok() || !b.ok() || (r[1].to_string() == frames[0].to_string() && s >= seq))
            continue;
          const auto l = index_->LastSeq(t->first, t->second);
          if (!l || s > *l) index_->Apply(t->first, t->second, s, *b);
          ++replayed_;
        }
      } catch (const zmq::error_t&) {
        ++errors_;
      }
    }
    index_->Apply(topic->first, topic->second, seq, *batch);
    ++messages_;
  }
}

}  // namespace attnd::client
